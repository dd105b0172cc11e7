"""Prefix caching on the real pair: a shared system prompt is prefilled once, usage says so in
OpenAI's fields, and an aborted session's blocks leave the live gauge at once but stay reusable."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.metrics import m
from tests.support.pair import LONG, Server, check_abort_figures, drop, post_raw, start_server
from tests.support.raw_http import read_events, sse_json

pytestmark = pytest.mark.timeout(180)

BLOCK = 16


def system_prompt() -> str:
    """About 1,500 byte tokens, unique per call so that no earlier test warmed the cache."""
    return f"[{secrets.token_hex(4)}] " + "Answer as a terse, careful assistant. " * 39


def chat(system: str, question: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}],
            "max_tokens": 4, "temperature": 0, **extra}


def chat_usage(server: Server, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """The response's usage and how many prompt tokens the daemon prefilled for it."""
    before = m(server.metrics(), "tether_prompt_tokens_total")
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"], m(server.metrics(), "tether_prompt_tokens_total") - before


def test_a_second_request_with_the_same_system_prompt_prefills_a_fraction(server: Server) -> None:
    system = system_prompt()
    before = server.metrics()
    first, first_prefill = chat_usage(server, chat(system, "What is one plus one?"))
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert first_prefill == first["prompt_tokens"] > 1400
    second, second_prefill = chat_usage(server, chat(system, "Name a colour."))
    cached = second["prompt_tokens_details"]["cached_tokens"]
    shared = len(system)  # byte tokens; BOS and the template's head are shared too
    assert cached % BLOCK == 0 and cached >= shared - BLOCK
    assert second_prefill == second["prompt_tokens"] - cached
    assert second_prefill <= 0.2 * shared
    after = server.metrics()
    hits = m(after, "tether_prefix_cache_hits_total") - m(before, "tether_prefix_cache_hits_total")
    queries = (m(after, "tether_prefix_cache_queries_total")
               - m(before, "tether_prefix_cache_queries_total"))
    assert hits == cached and queries == first["prompt_tokens"] + second["prompt_tokens"]
    assert m(after, "tether_kv_cache_blocks_used") == 0
    assert m(after, "tether_kv_cache_blocks_cached") >= cached // BLOCK


def test_streaming_usage_reports_cached_tokens(server: Server) -> None:
    system = system_prompt()
    chat_usage(server, chat(system, "warm up"))
    body = chat(system, "again", stream=True, stream_options={"include_usage": True})
    with server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as s:
        usages = [e["usage"] for e in map(sse_json, s.iter_lines()) if e and e.get("usage")]
    assert usages[-1]["prompt_tokens_details"]["cached_tokens"] >= len(system) - BLOCK


def test_a_responses_conversation_reuses_the_previous_turns(server: Server) -> None:
    system = system_prompt()
    with server.client() as c:
        first = c.post("/v1/responses", json={
            "instructions": system, "input": "Turn one.", "max_output_tokens": 8}).json()
        assert first["usage"]["input_tokens_details"]["cached_tokens"] == 0
        second = c.post("/v1/responses", json={
            "instructions": system, "input": "Turn two.", "max_output_tokens": 8,
            "previous_response_id": first["id"]}).json()
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert first["usage"]["input_tokens"] - BLOCK <= cached < second["usage"]["input_tokens"]


def test_abort_of_a_cached_session_frees_its_blocks_and_keeps_the_cache(server: Server) -> None:
    system = system_prompt()
    chat_usage(server, chat(system, "warm up"))
    before = server.metrics()
    sock = post_raw(server, "/v1/chat/completions", {**chat(system, "go on"), **LONG,
                                                      "max_tokens": 400, "stream": True})
    read_events(sock, 5)
    drop(sock)
    after = check_abort_figures(server, before)  # KV used back to 0
    assert m(after, "tether_kv_cache_blocks_cached") >= len(system) // BLOCK
    usage, prefill = chat_usage(server, chat(system, "still there?"))
    assert usage["prompt_tokens_details"]["cached_tokens"] >= len(system) - BLOCK
    assert prefill <= 0.2 * len(system)


@pytest.fixture(scope="module")
def uncached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("e2e-nocache"), ["--no-prefix-caching"])
    yield s
    s.stop()


def test_no_prefix_caching_prefills_every_prompt_in_full(uncached: Server) -> None:
    system = system_prompt()
    chat_usage(uncached, chat(system, "one"))
    usage, prefill = chat_usage(uncached, chat(system, "two"))
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert prefill == usage["prompt_tokens"]
    metrics = uncached.metrics()
    assert m(metrics, "tether_prefix_cache_queries_total") == 0
    assert m(metrics, "tether_kv_cache_blocks_cached") == 0
