"""/metrics tells the truth: no gauges of a dead daemon, aborts counted when written, Responses
requests in the latency histograms, aborts of requests still in the pipe counted, prefill tokens
counted as prefill however they are chunked."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.support.faults import shrink_and_fill, stopped
from tests.support.metrics import m
from tests.support.pair import LONG, Server, post_raw, start_server, wait_aborts
from tests.support.raw_http import read_events
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(240)

DAEMON_GAUGES = ("tether_requests_running", "tether_requests_waiting",
                 "tether_kv_cache_blocks_used", "tether_kv_cache_blocks_total",
                 "tether_conversation_placeholders")

DAEMON_COUNTERS: tuple[tuple[str, dict[str, str]], ...] = (
    ("tether_generation_tokens_total", {}), ("tether_prompt_tokens_total", {}),
    ("tether_engine_ticks_total", {}), ("tether_requests_finished_total", {"reason": "length"}))


def _streams(server: Server, count: int) -> list:
    socks = [post_raw(server, "/v1/completions", {"prompt": f"s{i}", "stream": True, **LONG})
             for i in range(count)]
    for sock in socks:
        read_events(sock, 2)
    return socks


def test_a_dead_daemon_shows_no_gauges(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        socks = _streams(server, 3)
        assert m(server.metrics(), "tether_requests_running") == 3
        server.kill("daemon")
        wait_for(lambda: m(server.metrics(), "tether_daemon_up") == 0, 5, "the proxy sees it")
        seen = server.metrics()
        assert not [g for g in DAEMON_GAUGES if g in seen], seen
        for sock in socks:
            sock.close()
    finally:
        server.stop()


def test_a_dead_daemons_counters_keep_their_last_values(tmp_path: Path) -> None:
    """Prometheus reads a counter that drops to 0 as a reset: while no daemon is connected its
    counters stay where they were (docs/operations.md, Metrics)."""
    server = start_server(tmp_path)
    try:
        with server.client() as c:
            r = c.post("/v1/completions", json={"prompt": "count me", "max_tokens": 5,
                                                "ignore_eos": True})
            assert r.status_code == 200, r.text
        wait_for(lambda: m(server.metrics(), "tether_generation_tokens_total") == 5, 5,
                 "the daemon's Stats")
        before = server.metrics()
        server.kill("daemon")
        wait_for(lambda: m(server.metrics(), "tether_daemon_up") == 0, 5, "the proxy sees it")
        away = server.metrics()
        for name, labels in DAEMON_COUNTERS:
            assert m(away, name, **labels) == m(before, name, **labels) > 0, (name, labels)
    finally:
        server.stop()


def test_aborts_sent_counts_only_aborts_written(tmp_path: Path) -> None:
    """Aborts the proxy could only queue (the control pipe full) and then dropped with the lost
    connection were never sent."""
    server = start_server(tmp_path)
    try:
        socks = _streams(server, 3)
        with stopped(server.daemon):
            filler = shrink_and_fill(tmp_path / "run" / "control")
            for sock in socks:
                sock.close()
            # The daemon is silent for 3 s: lost, and the queued aborts go with the connection.
            wait_for(lambda: m(server.metrics(), "tether_daemon_up") == 0, 10, "the loss")
            os.close(filler)
        server.wait_health(200)
        assert m(server.metrics(), "tether_proxy_aborts_sent_total",
                 cause="client_disconnect") == 0
    finally:
        server.stop()


def test_responses_feed_the_latency_histograms(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        before = server.metrics()
        body = {"input": "hello", "max_output_tokens": 4, "ignore_eos": True}
        with server.client() as c:
            assert c.post("/v1/responses", json=body).status_code == 200
            with c.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                r.read()
        after = server.metrics()
        ttft = "tether_time_to_first_token_seconds_count"
        assert m(after, ttft) - m(before, ttft) == 2
        duration = "tether_request_duration_seconds_count"
        assert m(after, duration, endpoint="responses") - m(
            before, duration, endpoint="responses") == 2
    finally:
        server.stop()


def test_aborts_of_requests_still_in_the_pipe_are_counted(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        with stopped(server.daemon):
            sock = post_raw(server, "/v1/completions", {"prompt": "queued", **LONG})
            wait_for(lambda: m(server.metrics(), "tether_proxy_sessions_waiting") == 1, 10,
                     "the proxy holds the request")
            sock.close()
            wait_for(lambda: m(server.metrics(), "tether_proxy_aborts_sent_total",
                               cause="client_disconnect") == 1, 10, "the abort is written")
        after = wait_aborts(server, "client_disconnect", 1)
        assert m(after, "tether_requests_finished_total", reason="abort") == 1
        assert m(after, "tether_prompt_tokens_total") == 0  # never prefilled
    finally:
        server.stop()


def test_a_one_token_prefill_chunk_counts_as_prefill(tmp_path: Path) -> None:
    server = start_server(tmp_path, ["--max-tokens-per-tick", "64", "--max-num-seqs", "8"])
    try:
        before = server.metrics()
        with server.client() as c:
            # 64 characters and BOS: chunks of 64 and 1 tokens.
            r = c.post("/v1/completions", json={"prompt": "y" * 64, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 65
        time.sleep(0.3)
        after = server.metrics()
        assert m(after, "tether_prompt_tokens_total") - m(before, "tether_prompt_tokens_total") == 65
        assert m(after, "tether_generation_tokens_total") - m(
            before, "tether_generation_tokens_total") == 1
    finally:
        server.stop()


def test_http_answers_are_counted_by_route_template_and_status(tmp_path: Path) -> None:
    """Every answer, the refused ones included, under its route's template: never the path a
    client chose (an unknown path counts as `unmatched`), so the series stay few."""
    server = start_server(tmp_path, ["--model", "sim:5"], api_key="k")
    try:
        before = server.metrics()
        with server.client() as c:
            answers = [c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}),
                       c.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}),
                       c.get("/v1/responses/resp_nope"), c.get("/v1/models/nope"),
                       c.get("/nowhere/at-all")]
            answers.append(c.post("/v1/completions", headers={"Authorization": "Bearer no"},
                                  json={"prompt": "x", "max_tokens": 2}))
        assert [a.status_code for a in answers] == [200, 400, 404, 404, 404, 401]
        after = server.metrics()
    finally:
        server.stop()
    counted = {(route, status): m(after, "tether_http_requests_total", route=route,
                                  status=status)
               - m(before, "tether_http_requests_total", route=route, status=status)
               for route, status in (("/v1/completions", "200"), ("/v1/completions", "400"),
                                     ("/v1/completions", "401"),
                                     ("/v1/responses/{response_id}", "404"),
                                     ("/v1/models/{model:path}", "404"), ("unmatched", "404"))}
    assert set(counted.values()) == {1.0}
    assert not [k for k in after if "nowhere" in k or "resp_nope" in k]
