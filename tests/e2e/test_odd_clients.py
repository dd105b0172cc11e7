"""Clients that misbehave at the HTTP level against a real pair: headers trickled a byte at a
time, bodies that never complete, 2,000 idle keep-alive connections. Each costs a bounded
amount of proxy memory, and the well-behaved client beside them is served as usual."""

from __future__ import annotations

import resource
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import orjson
import psutil
import pytest

from tests.support.metrics import m
from tests.support.pair import Server, assert_baseline, start_server
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(300)

IDLE_CONNECTIONS = 2000
# Generous: uvicorn's connection object, its transport and buffers are a few KB each.
MAX_BYTES_PER_CONNECTION = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * IDLE_CONNECTIONS + 512  # both ends live here and in the proxy (which inherits it)
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the open-files hard limit {hard} is below the {need} this test needs")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    s = start_server(tmp_path_factory.mktemp("odd"), ["--max-num-seqs", "8"])
    try:
        yield s
    finally:
        s.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _rss(server: Server) -> int:
    assert server.proxy is not None
    return int(psutil.Process(server.proxy.pid).memory_info().rss)


def _served(server: Server) -> None:
    """A well-behaved client: a short completion, answered in full."""
    with server.client(timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def _request(body: dict[str, object]) -> bytes:
    data = orjson.dumps(body)
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


def test_headers_trickled_a_byte_at_a_time(server: Server) -> None:
    raw = _request({"prompt": "x", "max_tokens": 3, "ignore_eos": True})
    answers: list[bytes] = []

    def trickle() -> None:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
            for i in range(len(raw)):
                sock.sendall(raw[i:i + 1])
                time.sleep(0.01)
            got = b""
            while b'"usage"' not in got:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                got += chunk
            answers.append(got)

    slow = [threading.Thread(target=trickle) for _ in range(20)]
    for thread in slow:
        thread.start()
    while any(t.is_alive() for t in slow):
        _served(server)  # never waits behind the slow ones
    for thread in slow:
        thread.join()
    assert len(answers) == 20 and all(a.startswith(b"HTTP/1.1 200") for a in answers), answers


def test_bodies_that_never_complete(server: Server) -> None:
    before_rss, before = _rss(server), server.metrics()
    socks = []
    for _ in range(200):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(_request({"prompt": "x" * 500})[:-400])  # headers and part of the body
        socks.append(sock)
    try:
        _served(server)
        assert _rss(server) - before_rss <= 200 * MAX_BYTES_PER_CONNECTION
        figures = server.metrics()
        assert m(figures, "tether_requests_waiting") == 0  # none of them reached the engine
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: m(server.metrics(), "tether_proxy_sessions") == 0, 30, "no proxy session")
    after = server.metrics()
    assert_baseline(after)
    assert m(after, "tether_aborts_total", cause="client_disconnect") == m(
        before, "tether_aborts_total", cause="client_disconnect")
    log = (server.tmp / "proxy.log").read_text(errors="replace")
    assert "unhandled error" not in log and "Traceback" not in log


def test_thousands_of_idle_keep_alive_connections(server: Server) -> None:
    before = _rss(server)
    socks = []
    try:
        for _ in range(IDLE_CONNECTIONS):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            socks.append(sock)
        for sock in socks:  # every one answered, and left open (keep-alive)
            got = b""
            while b"}" not in got:
                chunk = sock.recv(4096)
                assert chunk, "the server closed a keep-alive connection"
                got += chunk
            assert got.startswith(b"HTTP/1.1 200")
        held = _rss(server) - before
        print(f"proxy RSS +{held / 2**20:.1f} MiB for {IDLE_CONNECTIONS} idle connections "
              f"({held / IDLE_CONNECTIONS / 1024:.1f} KiB each)")
        assert held <= IDLE_CONNECTIONS * MAX_BYTES_PER_CONNECTION
        _served(server)
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        for sock in socks:
            sock.close()
