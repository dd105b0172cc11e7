"""Flow control end to end: a client that never reads costs a bounded lead of tokens and of proxy
memory, nobody else notices, and the stall timeout ends it."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import orjson
import psutil
import pytest

from tests.support.metrics import m
from tests.support.pair import Server, assert_baseline, start_server, wait_aborts
from tests.support.streams import Bystanders
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(300)

STALL_TIMEOUT_S = 20
MAX_TOKENS = 2000
N = 8


def never_reading_client(server: Server, body: dict[str, object]) -> socket.socket:
    """A client with a 4 KB receive window that sends its request and never reads a byte."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    data = orjson.dumps(body)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def settled(server: Server, name: str, quiet_s: float = 3.0, timeout: float = 90.0) -> float:
    """The counter's value once it has not moved for `quiet_s` seconds."""
    last, since = -1.0, time.monotonic()
    deadline = since + timeout
    while time.monotonic() < deadline:
        value = m(server.metrics(), name)
        now = time.monotonic()
        if value != last:
            last, since = value, now
        elif now - since >= quiet_s:
            return value
        time.sleep(0.25)
    raise AssertionError(f"{name} still moving after {timeout:.0f} s (at {last})")


def test_a_client_that_never_reads_costs_a_bounded_lead(tmp_path: Path) -> None:
    server = start_server(tmp_path, ["--max-num-seqs", "16",
                                     "--stall-timeout-s", str(STALL_TIMEOUT_S)])
    try:
        assert server.proxy is not None
        proxy = psutil.Process(server.proxy.pid)
        rss_before = proxy.memory_info().rss
        sock = never_reading_client(server, {
            "prompt": "never read", "n": N, "logprobs": 20, "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True})
        wait_for(lambda: m(server.metrics(), "tether_requests_paused") == 1, 60,
                 "the never-reading client's stream is paused")
        generated = settled(server, "tether_generation_tokens_total")
        paused = server.metrics()
        grown = proxy.memory_info().rss - rss_before
        print(f"lead {generated:.0f} tokens of {N * MAX_TOKENS}; proxy RSS +{grown / 2**20:.1f} MiB")
        # The session is alive, holds its KV, and the engine has stopped generating for it.
        assert m(paused, "tether_requests_running") == 1
        assert m(paused, "tether_requests_paused") == 1
        assert m(paused, "tether_aborts_total", cause="timeout") == 0
        assert generated < N * MAX_TOKENS / 8, generated
        assert grown < 30 * 2**20

        Bystanders(server.url, 4).start().assert_all_ok()

        after = wait_aborts(server, "timeout", 1, timeout=STALL_TIMEOUT_S + 30)
        assert_baseline(after)
        assert m(after, "tether_requests_paused") == 0
        sock.close()
    finally:
        server.stop()
