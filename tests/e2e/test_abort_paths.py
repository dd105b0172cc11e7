"""Every abort path, on the real daemon and proxy: drop a real connection, then assert the daemon's
state (running, waiting, KV blocks, placeholders) is back to baseline in the tick that applied it."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest

from tests import raw_http
from tests.e2e.conftest import (
    Server,
    assert_baseline,
    m,
    start_server,
    wait_aborts,
    wait_for,
)
from tests.raw_http import read_events

pytestmark = pytest.mark.timeout(180)

LONG = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}


def post_raw(server: Server, path: str, body: dict[str, Any]) -> socket.socket:
    return raw_http.post_raw(server.port, path, body, key=server.api_key)


def drop(sock: socket.socket) -> None:
    sock.close()


def wait_running(server: Server, at_least: int = 1, gauge: str = "tether_requests_running") -> None:
    wait_for(lambda: m(server.metrics(), gauge) >= at_least, 60, f"{gauge} >= {at_least}")


def check_abort(server: Server, before: dict[str, float], cause: str, sequences: int,
                aborts: int = 1) -> dict[str, float]:
    after = wait_aborts(server, cause, m(before, "tether_aborts_total", cause=cause) + aborts)
    assert_baseline(after)
    assert m(after, "tether_aborts_total", cause=cause) == m(
        before, "tether_aborts_total", cause=cause) + aborts
    wasted = (m(after, "tether_tokens_after_disconnect_total")
              - m(before, "tether_tokens_after_disconnect_total"))
    assert wasted <= sequences, f"{wasted} tokens generated after the disconnect"
    finished = m(after, "tether_requests_finished_total", reason="abort") - m(
        before, "tether_requests_finished_total", reason="abort")
    assert finished == aborts
    # The tick that applies an abort is the first to start after the record was written: at most
    # one tick can slip in between the proxy stamping the disconnect and writing the record.
    observed = m(after, "tether_abort_latency_ticks_count") - m(
        before, "tether_abort_latency_ticks_count")
    within_one = m(after, "tether_abort_latency_ticks_bucket", le="1.0") - m(
        before, "tether_abort_latency_ticks_bucket", le="1.0")
    assert observed == aborts and within_one == aborts
    return after


CHAT = {"messages": [{"role": "user", "content": "tell me everything"}], **LONG}


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/v1/completions", {"prompt": "once upon a time", "stream": True, **LONG}),
])
def test_streaming_disconnect_evicts_session(server: Server, path: str,
                                             body: dict[str, Any]) -> None:
    before = server.metrics()
    sock = post_raw(server, path, body)
    read_events(sock, 5)
    drop(sock)
    check_abort(server, before, "client_disconnect", sequences=1)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"prompt": "once upon a time", **LONG}),
])
def test_non_streaming_disconnect_evicts_session(server: Server, path: str,
                                                 body: dict[str, Any]) -> None:
    before = server.metrics()
    sock = post_raw(server, path, body)
    wait_running(server)
    drop(sock)
    check_abort(server, before, "client_disconnect", sequences=1)


def test_prompt_list_and_n_evict_every_sequence(server: Server) -> None:
    before = server.metrics()
    body = {"prompt": ["first prompt", "second prompt"], "n": 2, "stream": True, **LONG}
    sock = post_raw(server, "/v1/completions", body)
    read_events(sock, 8)
    assert m(server.metrics(), "tether_requests_running") == 1  # one request, four sequences
    drop(sock)
    check_abort(server, before, "client_disconnect", sequences=4)


def test_queued_request_is_never_prefilled(tmp_path: Any) -> None:
    server = start_server(tmp_path, ["--max-num-seqs", "1"])
    try:
        busy = post_raw(server, "/v1/completions", {"prompt": "hold the slot", "stream": True, **LONG})
        read_events(busy, 2)
        queued = post_raw(server, "/v1/completions", {"prompt": "never computed " * 20, **LONG})
        wait_running(server, 1, "tether_requests_waiting")
        before = server.metrics()
        drop(queued)
        after = wait_aborts(server, "client_disconnect", 1)
        assert m(after, "tether_requests_waiting") == 0
        assert m(after, "tether_requests_running") == 1
        assert m(after, "tether_prompt_tokens_total") == m(before, "tether_prompt_tokens_total")
        assert m(after, "tether_tokens_after_disconnect_total") == 0
        drop(busy)
        assert_baseline(wait_aborts(server, "client_disconnect", 2))
    finally:
        server.stop()


def test_normal_finish_writes_no_abort(server: Server) -> None:
    before = server.metrics()
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "short", "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        with c.stream("POST", "/v1/chat/completions",
                      json={**CHAT, "max_tokens": 5, "stream": True}) as s:
            assert [line for line in s.iter_lines() if line][-1] == "data: [DONE]"
    time.sleep(0.5)  # give a stray abort record every chance to arrive
    after = server.metrics()
    assert sum(v for k, v in after.items() if k.startswith("tether_aborts_total")) == sum(
        v for k, v in before.items() if k.startswith("tether_aborts_total"))
    assert_baseline(after)
