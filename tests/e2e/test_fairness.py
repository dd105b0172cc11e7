"""One client's request size never costs another client its work, on the real pair: a request
over the sequence cap is refused naming it; one at the cap, or n=64 with 20 logprobs each, still
lets another client's small request through within a few ticks; and one that could collect more
than the proxy's budget for an answer is refused up front, costing the proxy no memory."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.support.metrics import m
from tests.support.pair import Server, drop, post_raw, start_server, wait_running
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(240)

# A small request's whole life behind a big one: a tick or two to get in, two tokens, the HTTP
# round trip; generous for a loaded 2-core machine. Served in turn, the big ones here take
# tens of seconds.
SMALL_WITHIN_S = 5.0
SMALL = {"prompt": "small", "max_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Default caps (256 sequences a request, 64 at once); ticks of 20 ms."""
    s = start_server(tmp_path_factory.mktemp("e2e-fair-sim"), ["--model", "sim:20"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("e2e-fair-tiny"), ["--max-num-seqs", "64"])
    yield s
    s.stop()


def small_request_seconds(server: Server, big: dict[str, object]) -> float:
    """How long a small request takes while `big` (sent first, never read) runs; `big` is
    still running when the small one is done, and is dropped after."""
    sock = post_raw(server, "/v1/completions", big)
    try:
        wait_running(server)
        wait_for(lambda: m(server.metrics(), "tether_generation_tokens_total") > 0, 60,
                 "the big request generating")
        start = time.monotonic()
        with server.client(timeout=120) as c:
            r = c.post("/v1/completions", json=SMALL)
        took = time.monotonic() - start
        assert r.status_code == 200, r.text[:300]
        assert r.json()["usage"]["completion_tokens"] == 2
        assert m(server.metrics(), "tether_requests_running") >= 1, "the big one finished first"
        return took
    finally:
        drop(sock)


def test_a_request_over_the_sequence_cap_is_refused_naming_the_limit(sim: Server) -> None:
    with sim.client() as c:
        r = c.post("/v1/completions", json={"prompt": ["p"] * 256, "n": 2, "max_tokens": 1})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("n", "too_many_sequences")
    assert "512 sequences (256 prompts x n=2)" in error["message"]
    assert "limit of 256 per request" in error["message"]


def test_a_request_at_the_sequence_cap_does_not_hold_up_a_small_one(sim: Server) -> None:
    big = {"prompt": ["a", "b", "c", "d"], "n": 64, "max_tokens": 400, "ignore_eos": True}
    took = small_request_seconds(sim, big)
    print(f"small request behind 4 x n=64: {took:.2f} s")
    assert took < SMALL_WITHIN_S


def test_n64_with_20_logprobs_does_not_hold_up_a_small_one(tiny: Server) -> None:
    # Just within the collected-output budget: 64 x 200 tokens x 21 log-probability entries.
    big = {"prompt": "big", "n": 64, "logprobs": 20, "max_tokens": 200, "ignore_eos": True}
    took = small_request_seconds(tiny, big)
    print(f"small request behind n=64 with 20 logprobs: {took:.2f} s")
    assert took < SMALL_WITHIN_S


def test_an_answer_over_the_proxy_budget_is_refused_up_front_at_no_memory(tiny: Server) -> None:
    assert tiny.proxy is not None
    proxy = psutil.Process(tiny.proxy.pid)
    body = {"prompt": "big", "n": 64, "logprobs": 20, "max_tokens": 1000, "ignore_eos": True}
    before = proxy.memory_info().rss
    with tiny.client(timeout=10) as c:
        for _ in range(4):
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 400, r.text[:300]
            error = r.json()["error"]
            assert (error["param"], error["code"]) == ("max_tokens", "output_too_large")
            assert "limit of 67108864" in error["message"] and "stream" in error["message"]
    grown = proxy.memory_info().rss - before
    print(f"proxy RSS +{grown / 2**20:.1f} MiB after 4 refused answers")
    assert grown < 8 * 2**20
    # Streamed, nothing is collected: the same request is taken (and dropped here).
    sock = post_raw(tiny, "/v1/completions", {**body, "stream": True})
    sock.settimeout(30)
    assert sock.recv(64).startswith(b"HTTP/1.1 200")
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    wait_for(lambda: m(tiny.metrics(), "tether_requests_running") == 0, 60, "the stream dropped")
    with httpx.Client(base_url=tiny.url, timeout=30) as c:
        assert c.post("/v1/completions", json=SMALL).status_code == 200
