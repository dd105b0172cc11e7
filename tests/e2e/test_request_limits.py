"""Request heads and bodies that never end, or end too far away (issue 21, failure 4): a head
past the size limit gets 431 and the connection closed, a head or body that trickles is cut off
in time, and twenty connections pushing megabytes of unfinished header cost the proxy no more
than their limit."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import orjson
import psutil
import pytest

from tests.support.metrics import m
from tests.support.pair import Server, start_server
from tests.support.raw_http import closing_error, read_plain, read_until_closed
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(240)

KIB = 1024
MIB = 1024 * KIB
HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Short time limits, the default size limit (64 KiB of head)."""
    s = start_server(tmp_path_factory.mktemp("limits"), [
        "--model", "sim:2", "--header-timeout-s", "1", "--body-timeout-s", "1",
        "--body-min-rate", "1000"])
    yield s
    s.stop()


def _connect(server: Server, timeout: float = 15.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=timeout)


def _send_quietly(sock: socket.socket, data: bytes) -> threading.Thread:
    """Sends `data` from a thread; the server may close before it is all sent."""
    def send() -> None:
        try:
            sock.sendall(data)
        except OSError:
            pass

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _check_431(answer: bytes) -> None:
    error = closing_error(answer, 431)
    assert error["type"] == "invalid_request_error" and "65536" in error["message"], error


@pytest.mark.parametrize("size", [100 * KIB, 1 * MIB], ids=["100KB", "1MB"])
def test_a_header_past_the_limit_gets_431_and_the_connection_closed(
        server: Server, size: int) -> None:
    with _connect(server) as sock:
        sender = _send_quietly(sock, HEALTH + b"X-Pad: " + b"a" * size + b"\r\n\r\n")
        _check_431(read_until_closed(sock))
        sender.join(15)
    assert server.health() == 200


def test_a_hundred_thousand_header_lines_get_431(server: Server) -> None:
    with _connect(server) as sock:
        sender = _send_quietly(sock, HEALTH + b"X-Line: a\r\n" * 100_000 + b"\r\n")
        _check_431(read_until_closed(sock))
        sender.join(15)


def test_a_head_just_under_the_limit_is_served(server: Server) -> None:
    pad = 64 * KIB - len(HEALTH) - len(b"X-Pad: \r\n\r\n")
    with _connect(server) as sock:
        sock.sendall(HEALTH + b"X-Pad: " + b"a" * pad + b"\r\n\r\n")
        assert read_plain(sock)[0].startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("after_a_request", [False, True], ids=["first", "kept-alive"])
def test_a_trickled_header_is_closed_after_the_header_timeout(
        server: Server, after_a_request: bool) -> None:
    with _connect(server) as sock:
        if after_a_request:
            sock.sendall(HEALTH + b"\r\n")
            assert read_plain(sock)[0].startswith(b"HTTP/1.1 200")
        sock.sendall(HEALTH)
        t0 = time.monotonic()
        closed = threading.Event()
        sender = threading.Thread(target=_trickle, args=(sock, closed), daemon=True)
        sender.start()
        assert read_until_closed(sock) == b""  # no answer: closed
        elapsed = time.monotonic() - t0
        closed.set()
        sender.join(15)
    assert 0.5 < elapsed < 15, elapsed


def _trickle(sock: socket.socket, stop: threading.Event, byte: bytes = b"a",
             every_s: float = 0.2) -> None:
    """One byte of a header value every `every_s` seconds, for a minute (far past the timeout)."""
    try:
        sock.sendall(b"X-Slow: ")
        for _ in range(int(60 / every_s)):
            if stop.wait(every_s):
                return
            sock.sendall(byte)
    except OSError:
        return


def _body_head(length: int) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            b"\r\nContent-Length: " + str(length).encode() + b"\r\n\r\n")


def test_a_body_that_never_completes_is_closed_after_the_body_timeout(server: Server) -> None:
    with _connect(server) as sock:
        sock.sendall(_body_head(1000) + b'{"prompt": "')
        t0 = time.monotonic()
        assert read_until_closed(sock) == b""
    assert 0.5 < time.monotonic() - t0 < 15
    assert m(server.metrics(), "tether_requests_waiting") == 0
    assert "Traceback" not in server.log("proxy")


def test_a_body_slower_than_the_minimum_rate_is_closed(server: Server) -> None:
    """20 bytes a second against a minimum of 1000: each byte buys 1 ms, the timeout is 1 s."""
    body = orjson.dumps({"prompt": "x" * 2000, "max_tokens": 1})
    with _connect(server) as sock:
        sock.sendall(_body_head(len(body)))
        t0 = time.monotonic()
        stop = threading.Event()

        def trickle() -> None:
            try:
                for i in range(len(body)):
                    if stop.wait(0.05):
                        return
                    sock.sendall(body[i:i + 1])
            except OSError:
                return

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        assert read_until_closed(sock) == b""
        elapsed = time.monotonic() - t0
        stop.set()
        sender.join(15)
    assert 0.5 < elapsed < 15, elapsed


def test_a_body_at_a_good_rate_may_take_longer_than_the_timeout(server: Server) -> None:
    """10 KB at 5 KB/s: 2 s in all, but each 1000 bytes buys another second."""
    body = orjson.dumps({"prompt": "x " * 5000, "max_tokens": 1})
    with _connect(server) as sock:
        sock.sendall(_body_head(len(body)))
        for i in range(0, len(body), 500):
            sock.sendall(body[i:i + 500])
            time.sleep(0.1)
        status, answer = read_plain(sock)
        assert status.startswith(b"HTTP/1.1 200"), answer


def test_huge_unfinished_headers_cost_bounded_memory(server: Server) -> None:
    """Twenty connections each pushing 8 MiB of a header that never ends (before: all of it
    held, RSS +700 MB at 32 MiB each)."""
    assert server.proxy is not None
    proxy = psutil.Process(server.proxy.pid)
    before = proxy.memory_info().rss
    socks = [_connect(server, 30) for _ in range(20)]
    try:
        senders = [_send_quietly(sock, HEALTH + b"X-Huge: " + b"a" * (8 * MIB)) for sock in socks]
        for sender in senders:
            sender.join(120)
        grown = 0
        for _ in range(5):
            grown = max(grown, proxy.memory_info().rss - before)
            time.sleep(0.2)
        print(f"proxy RSS +{grown / MIB:.1f} MiB after 20 x 8 MiB of unfinished header")
        assert grown < 32 * MIB
        for sock in socks:
            _check_431(read_until_closed(sock))
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: server.health() == 200, 30, "the proxy to answer")
