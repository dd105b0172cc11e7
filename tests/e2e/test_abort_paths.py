"""Every abort path, on the real daemon and proxy: drop a real connection, then assert the daemon's
state (running, waiting, KV blocks, placeholders) is back to baseline in the tick that applied it,
and, per request on the client's clock, how many tokens were generated after the close."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.metrics import m
from tests.support.pair import (
    CHAT,
    LONG,
    Server,
    assert_baseline,
    check_abort,
    drop,
    drop_mid_stream,
    new_rid,
    post_raw,
    start_server,
    wait_aborts,
    wait_running,
)
from tests.support.raw_http import read_events, read_to_end

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(abort_server: Server) -> Server:
    """Drops here are judged from the client's close: builtin:small's long ticks (conftest)."""
    return abort_server


# A forced tool call whose arguments take over a thousand tokens: a stream of argument pieces
# (its grammar, a session's state, goes with the session).
TOOL_CALL = {"messages": CHAT["messages"], "max_tokens": 1200, "temperature": 0,
             "tool_choice": "required", "tools": [{"type": "function", "function": {
                 "name": "write", "parameters": {"type": "object", "properties": {
                     "text": {"type": "string", "minLength": 1000}}, "required": ["text"]}}}]}


# A long answer under a JSON schema: its matcher and mask rows go with the session.
GUIDED = {"messages": CHAT["messages"], "max_tokens": 1200, "response_format": {
    "type": "json_schema", "json_schema": {"name": "long", "schema": {
        "type": "object", "properties": {"text": {"type": "string", "minLength": 1000}},
        "required": ["text"]}}}}


# The Messages API's (Anthropic's) forced call: the same long arguments, through its own
# answer and events. The model's name is the abort server's (builtin:small).
MESSAGES = {"model": "builtin:small", "max_tokens": 1200, "temperature": 0,
            "messages": CHAT["messages"], "tool_choice": {"type": "any"}, "tools": [{
                "name": "write", "input_schema": TOOL_CALL["tools"][0]["function"]["parameters"]}]}


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/v1/completions", {"prompt": "once upon a time", "stream": True, **LONG}),
    # Sessions whose sequences hold penalty counts, biases and bans in the sampler.
    ("/v1/chat/completions", {**CHAT, "stream": True, "presence_penalty": 1.0,
                              "frequency_penalty": 0.5, "repetition_penalty": 1.2}),
    ("/v1/completions", {"prompt": "once upon a time", "stream": True, **LONG,
                         "logit_bias": {"101": 5, "32": -3}, "bad_words": ["the"],
                         "min_p": 0.05}),
    ("/v1/chat/completions", {**TOOL_CALL, "stream": True}),
    ("/v1/chat/completions", {**GUIDED, "stream": True}),
    ("/v1/messages", {**MESSAGES, "stream": True}),
], ids=["chat", "completion", "penalised", "biased", "tool_call", "guided", "messages"])
def test_streaming_disconnect_evicts_session(server: Server, path: str,
                                             body: dict[str, Any]) -> None:
    drop_mid_stream(server, path, body, "stream-drop")


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"prompt": "once upon a time", **LONG}),
    ("/v1/messages", MESSAGES),
])
def test_non_streaming_disconnect_evicts_session(server: Server, path: str,
                                                 body: dict[str, Any]) -> None:
    before = server.metrics()
    rid = new_rid("plain-drop")
    sock = post_raw(server, path, body, rid)
    wait_running(server)
    check_abort(server, before, rid, drop(sock), sequences=1)


def test_prompt_list_and_n_evict_every_sequence(server: Server) -> None:
    before = server.metrics()
    body = {"prompt": ["first prompt", "second prompt"], "n": 2, "stream": True, **LONG}
    sock = post_raw(server, "/v1/completions", body, "list-drop")
    read_events(sock, 8)
    assert m(server.metrics(), "tether_requests_running") == 1  # one request, four sequences
    check_abort(server, before, "list-drop", drop(sock), sequences=4)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "never computed " * 20, **LONG}),
    ("/v1/messages", {"model": "builtin:tiny", "max_tokens": 1500, "messages": [
        {"role": "user", "content": "never computed " * 20}]}),
], ids=["completion", "messages"])
def test_queued_request_is_never_prefilled(tmp_path: Path, path: str,
                                           body: dict[str, Any]) -> None:
    server = start_server(tmp_path, ["--max-num-seqs", "1"])
    try:
        busy = post_raw(server, "/v1/completions", {"prompt": "hold the slot", "stream": True, **LONG})
        read_events(busy, 2)
        queued = post_raw(server, path, body, "queued-drop")
        wait_running(server, 1, "tether_requests_waiting")
        before = server.metrics()
        drop(queued)
        after = wait_aborts(server, "client_disconnect", 1)
        assert m(after, "tether_requests_waiting") == 0
        assert m(after, "tether_requests_running") == 1
        assert m(after, "tether_prompt_tokens_total") == m(before, "tether_prompt_tokens_total")
        assert m(after, "tether_tokens_after_disconnect_total") == 0
        # In no forward pass at all: not a prefill chunk, not a token.
        line = server.request_line("queued-drop")
        assert line["cause"] == "client_disconnect" and line["last_ticks"] == [], line
        drop(busy)
        assert_baseline(wait_aborts(server, "client_disconnect", 2))
    finally:
        server.stop()


def test_normal_finish_writes_no_abort(server: Server) -> None:
    """The proxy counts each Abort as it writes it, in the handler's cleanup, before the response
    ends: a stray abort after a normal finish would show in this figure at once."""
    before = server.metrics()
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "short", "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        with c.stream("POST", "/v1/chat/completions",
                      json={**CHAT, "max_tokens": 5, "stream": True}) as s:
            assert [line for line in s.iter_lines() if line][-1] == "data: [DONE]"
    sock = post_raw(server, "/v1/completions", {"prompt": "p", "max_tokens": 3, "stream": True,
                                                "ignore_eos": True})
    assert read_to_end(sock).endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    sock.close()
    after = server.metrics()
    for cause in ("client_disconnect", "cancel", "shutdown"):
        assert m(after, "tether_proxy_aborts_sent_total", cause=cause) == m(
            before, "tether_proxy_aborts_sent_total", cause=cause), cause
    assert sum(v for k, v in after.items() if k.startswith("tether_aborts_total")) == sum(
        v for k, v in before.items() if k.startswith("tether_aborts_total"))
    assert_baseline(after)
