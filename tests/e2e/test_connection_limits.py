"""Sockets that cost the proxy descriptors without asking anything of it (issue 21, failure 3):
idle connections at systemd's 1024-descriptor soft limit, a connection cap that answers the
newcomer and never the established, and connections that send no request closed in time.

Each pair reports to a NotifyListener of the test's own, so a test sees the proxy's watchdog
pings, which `tether serve` and systemd judge it by (no WATCHDOG=1 for 30 s: SIGKILL).
"""

from __future__ import annotations

import functools
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.pair import Server, post_raw, start_server
from tests.support.raw_http import closing_error, read_to_end, read_until_closed, sse_events
from tests.support.wait import wait_for
from tether.sdnotify import NotifyListener

pytestmark = pytest.mark.timeout(240)

SYSTEMD_SOFT_LIMIT = 1024
IDLE_SOCKETS = 1050
# sim:20 ticks last 20 ms: a stream of 400 tokens goes on for 8 s at least, past the flood.
SIM = ["--model", "sim:20", "--max-num-seqs", "8"]


def _limit_open_files(soft: int, hard: int | None) -> None:
    """A child's preexec_fn: the descriptor limits a unit without LimitNOFILE= starts with."""
    _, inherited = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, inherited if hard is None else hard))


@pytest.fixture
def listener() -> Iterator[NotifyListener]:
    sock = NotifyListener()
    yield sock
    sock.close()


def _start(tmp: Path, listener: NotifyListener, extra: list[str], soft: int | None = None,
           hard: int | None = None) -> Server:
    preexec = None if soft is None else functools.partial(_limit_open_files, soft, hard)
    return start_server(tmp, [*SIM, *extra], preexec=preexec,
                        environ={"NOTIFY_SOCKET": listener.name})


def _pings(listener: NotifyListener, pid: int, count: int, timeout: float) -> None:
    """`count` WATCHDOG=1 from `pid`, the first of them sent after this call."""
    listener.receive()
    seen = 0

    def enough() -> bool:
        nonlocal seen
        seen += sum(1 for n in listener.receive() if n.pid == pid and n.fields.get("WATCHDOG"))
        return seen >= count

    wait_for(enough, timeout, f"{count} watchdog pings from the proxy (got {seen})")


class _Stream(threading.Thread):
    """A well-behaved streaming client on its own connection, read to its end."""

    def __init__(self, server: Server, tokens: int = 400) -> None:
        super().__init__(daemon=True)
        self.tokens = tokens
        self.sock = post_raw(server, "/v1/completions", {
            "prompt": "go", "max_tokens": tokens, "ignore_eos": True, "stream": True})
        self.raw = b""

    def run(self) -> None:
        self.raw = read_to_end(self.sock)
        self.sock.close()

    def check_complete(self) -> None:
        self.join(120)
        assert not self.is_alive(), "the stream did not end"
        assert self.raw.startswith(b"HTTP/1.1 200"), self.raw[:300]
        events = sse_events(self.raw.partition(b"\r\n\r\n")[2])
        assert events[-1] == "[DONE]", events[-3:]
        choices = [c for e in events[:-1] for c in e["choices"]]
        assert len("".join(c["text"] for c in choices).split()) == self.tokens
        assert choices[-1]["finish_reason"] == "length"  # one word a token, every one came


def _open_idle(port: int, count: int) -> list[socket.socket]:
    """Connections that never send a byte."""
    return [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(count)]


def _refused(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sent before it closed the connection. Past the few refusals the
    server lingers on, it closes at once, and the request then meets a reset: the answer
    came first all the same."""
    sock.settimeout(timeout)
    return read_until_closed(sock)


def _check_503(answer: bytes) -> None:
    error = closing_error(answer, 503)
    assert error["type"] == "service_unavailable" and "connections" in error["message"], error


def _proxy_fds(server: Server) -> int:
    assert server.proxy is not None
    return int(psutil.Process(server.proxy.pid).num_fds())


def _hard_limit_allows(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the open-files hard limit {hard} is below the {need} this test needs")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def test_idle_sockets_at_the_systemd_soft_limit_cost_no_ping_and_no_stream(
        tmp_path: Path, listener: NotifyListener) -> None:
    """The soft limit is 1024, the hard one higher (systemd's defaults): the proxy raises the
    soft one, takes every idle socket, keeps pinging and answering, and the stream ends whole."""
    _hard_limit_allows(2 * IDLE_SOCKETS + 512)
    server = _start(tmp_path, listener, [], soft=SYSTEMD_SOFT_LIMIT)
    idle: list[socket.socket] = []
    try:
        assert server.proxy is not None
        soft, hard = psutil.Process(server.proxy.pid).rlimit(psutil.RLIMIT_NOFILE)
        assert soft == hard and soft > SYSTEMD_SOFT_LIMIT
        stream = _Stream(server)
        stream.start()
        base = _proxy_fds(server)
        idle = _open_idle(server.port, IDLE_SOCKETS)
        wait_for(lambda: _proxy_fds(server) >= base + IDLE_SOCKETS, 30,
                 lambda: f"the proxy to accept {IDLE_SOCKETS} sockets (it holds "
                 f"{_proxy_fds(server)} descriptors)\n{server.logs()}")
        assert stream.is_alive()  # the flood came while the stream ran
        _pings(listener, server.proxy.pid, 2, 20)
        assert server.health() == 200
        stream.check_complete()
    finally:
        for sock in idle:
            sock.close()
        server.stop()
    log = server.log("proxy")
    assert "Too many open files" not in log and "Traceback" not in log


def test_at_a_hard_limit_of_1024_newcomers_get_503_and_the_established_go_on(
        tmp_path: Path, listener: NotifyListener) -> None:
    """No higher limit to raise to: the connection cap stays under the descriptor limit, so the
    watchdog socket and the established connections keep working, and a newcomer past the cap
    gets a 503 it can read instead of a connection nobody accepts."""
    _hard_limit_allows(2 * IDLE_SOCKETS + 512)
    server = _start(tmp_path, listener, [], soft=SYSTEMD_SOFT_LIMIT, hard=SYSTEMD_SOFT_LIMIT)
    idle: list[socket.socket] = []
    try:
        assert server.proxy is not None
        with httpx.Client(base_url=server.url, timeout=10) as monitor:
            assert monitor.get("/health").status_code == 200  # a keep-alive connection, held
            stream = _Stream(server)
            stream.start()
            idle = _open_idle(server.port, IDLE_SOCKETS)
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as newcomer:
                newcomer.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                _check_503(_refused(newcomer))
            assert stream.is_alive()
            _pings(listener, server.proxy.pid, 2, 20)
            assert monitor.get("/health").status_code == 200
            stream.check_complete()
        answered = [sock for sock in idle if _answer_waiting(sock)]
        assert IDLE_SOCKETS - SYSTEMD_SOFT_LIMIT < len(answered) < IDLE_SOCKETS - 512, len(answered)
        _check_503(_refused(answered[-1]))
    finally:
        for sock in idle:
            sock.close()
        server.stop()
    log = server.log("proxy")
    assert "Too many open files" not in log and "Traceback" not in log


def _answer_waiting(sock: socket.socket) -> bool:
    """Whether the server has sent something, or closed, on a connection that sent nothing."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    except ConnectionResetError:
        pass
    finally:
        sock.setblocking(True)
    return True


def test_newcomers_past_the_cap_get_503_while_an_established_stream_goes_on(
        tmp_path: Path, listener: NotifyListener) -> None:
    server = _start(tmp_path, listener, ["--max-connections", "8"])
    idle: list[socket.socket] = []
    try:
        stream = _Stream(server, tokens=200)
        stream.start()
        idle = _open_idle(server.port, 7)  # with the stream's, 8: the cap
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as newcomer:
                newcomer.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                _check_503(_refused(newcomer))
        assert not any(_answer_waiting(sock) for sock in idle)  # the established untouched
        assert stream.is_alive()
        for sock in idle:
            sock.close()
        idle = []
        wait_for(lambda: server.health() == 200, 30, "room again once the idle ones closed")
        stream.check_complete()
    finally:
        for sock in idle:
            sock.close()
        server.stop()


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A pair with a 1 s header timeout."""
    s = start_server(tmp_path_factory.mktemp("quick"), [*SIM, "--header-timeout-s", "1"])
    yield s
    s.stop()


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(
        quick: Server) -> None:
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", quick.port), timeout=30) as sock:
        assert _refused(sock, 15) == b""  # closed, with nothing to say
    assert 0.9 < time.monotonic() - t0 < 15


def test_an_idle_keep_alive_connection_outlives_the_header_timeout(quick: Server) -> None:
    """Between requests the keep-alive timeout rules (75 s, announced), not the header one."""
    with socket.create_connection(("127.0.0.1", quick.port), timeout=10) as sock:
        for _ in range(2):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            got = b""
            while b"}" not in got:
                chunk = sock.recv(4096)
                assert chunk, "the server closed a keep-alive connection"
                got += chunk
            assert got.startswith(b"HTTP/1.1 200") and b"keep-alive: timeout=75" in got
            time.sleep(2.5)
