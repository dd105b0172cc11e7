"""/v1/messages in the proxy, against the scripted daemon on real FIFOs: the Submit a message
becomes (the chat path's), the message and its events rendered from the records, and every
refusal of the route in Anthropic's shape and statuses, the middleware's too."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx
import pytest

from ipc.records import Message, ToolCall
from proxy.anthropic import answer
from proxy.options import ProxyOptions
from tests.proxy.conftest import running_app
from tests.support.peer import CACHED_TOKENS, MODEL, PROMPT_TOKENS, Peer
from tests.support.raw_http import sse_events
from tests.support.wait import wait_until

pytestmark = pytest.mark.anyio

ASK: dict[str, Any] = {"model": MODEL, "max_tokens": 3,
                       "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"name": "get", "input_schema": {"type": "object"}}


async def test_a_conversation_becomes_chat_messages(client: httpx.AsyncClient,
                                                    peer: Peer) -> None:
    body = {**ASK, "system": [{"type": "text", "text": "Be brief.",
                               "cache_control": {"type": "ephemeral"}}],
            "tools": [TOOL, {**TOOL, "name": "later", "defer_loading": True}],
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "t1", "name": "get", "input": {"a": 1}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                     "content": [{"type": "text", "text": "no"}]},
                    {"type": "text", "text": "again"}]},
                {"role": "system", "content": "# Environment"}]}
    r = await client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    submit = peer.submits[-1]
    assert submit.messages == [
        Message("system", "Be brief.\n\n# Environment"), Message("user", "hi"),
        Message("assistant", "calling", [ToolCall("t1", "get", '{"a":1}')]),
        Message("tool", "Error: no", tool_call_id="t1"), Message("user", "again")]
    assert [t.name for t in submit.tools] == ["get"]  # the deferred one is not offered
    assert submit.sampling.max_tokens_ceiling and submit.sampling.max_tokens == 3


async def test_the_message_and_its_events(client: httpx.AsyncClient) -> None:
    m = (await client.post("/v1/messages", json=ASK)).json()
    assert m["type"] == "message" and m["id"].startswith("msg_") and m["model"] == MODEL
    assert m["content"] == [{"type": "text", "text": "tok0 tok1 tok2 "}]
    assert m["stop_reason"] == "max_tokens" and m["stop_sequence"] is None
    assert m["usage"] == {"input_tokens": PROMPT_TOKENS - CACHED_TOKENS,
                          "cache_creation_input_tokens": 0,
                          "cache_read_input_tokens": CACHED_TOKENS, "output_tokens": 3}
    r = await client.post("/v1/messages", json={**ASK, "stream": True})
    events = sse_events(r.text)
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop"]
    assert "".join(e["delta"]["text"] for e in events[3:6]) == "tok0 tok1 tok2 "
    assert events[-2]["usage"]["cache_read_input_tokens"] == CACHED_TOKENS


async def test_count_tokens(client: httpx.AsyncClient, peer: Peer) -> None:
    r = await client.post("/v1/messages/count_tokens",
                          json={"model": MODEL, "messages": ASK["messages"], "tools": [TOOL]})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    assert [t.name for t in peer.submits[-1].tools] == ["get"]


def _error(r: httpx.Response, status: int, kind: str) -> str:
    body = r.json()
    assert r.status_code == status and body["type"] == "error", (r.status_code, body)
    assert body["error"]["type"] == kind, body
    return body["error"]["message"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(("change", "named"), [
    ({"frobnicate": 1}, "frobnicate"),
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0]"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [{**TOOL, "defer_loading": True}], "tool_choice": {"type": "tool",
                                                                  "name": "get"}},
     "tool_choice"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
     "context_management.edits[0].type"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"container": "c"}, "container"),
])
async def test_a_refusal_names_what_it_refuses(client: httpx.AsyncClient,
                                               change: dict[str, Any], named: str) -> None:
    body = {k: v for k, v in {**ASK, **change}.items() if v is not None}
    message = _error(await client.post("/v1/messages", json=body), 400, "invalid_request_error")
    assert named in message, message


async def test_unknown_model_and_route_are_not_found(client: httpx.AsyncClient) -> None:
    _error(await client.post("/v1/messages", json={**ASK, "model": "claude-x"}), 404,
           "not_found_error")
    _error(await client.post("/v1/messages/frobnicate", json=ASK), 404, "not_found_error")


async def test_overload_is_529(options: ProxyOptions, peer: Peer) -> None:
    """Too many requests waiting: the OpenAI routes' 429 is Anthropic's 529 overloaded."""
    options = dataclasses.replace(options, max_waiting=1)
    peer.hold = True
    async with running_app(options) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://p") as c:
            queued = asyncio.ensure_future(c.post("/v1/messages", json=ASK))
            await wait_until(lambda: app.state.engine.num_waiting == 1)
            r = await c.post("/v1/messages", json=ASK)
            _error(r, 529, "overloaded_error")
            assert (await c.post("/v1/chat/completions", json={
                "messages": ASK["messages"], "max_tokens": 1})).status_code == 429
            peer.hold = False
            assert (await queued).status_code == 200


async def test_the_key_and_the_middleware_refusals(options: ProxyOptions, peer: Peer) -> None:
    options = dataclasses.replace(options, api_keys=("sk-1",), max_body_bytes=4096)
    async with running_app(options) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://p") as c:
            _error(await c.post("/v1/messages", json=ASK), 401, "authentication_error")
            _error(await c.post("/v1/messages", json=ASK, headers={"x-api-key": "sk-2"}), 401,
                   "authentication_error")
            headers = {"x-api-key": "sk-1", "anthropic-version": "2023-06-01",
                       "anthropic-beta": "claude-code-20250219"}
            r = await c.post("/v1/messages?beta=true", json=ASK, headers=headers)
            assert r.status_code == 200, r.text
            big = {**ASK, "system": "x" * 5000}
            _error(await c.post("/v1/messages", json=big, headers=headers), 413,
                   "request_too_large")
            # The OpenAI routes keep their own shape.
            r = await c.post("/v1/chat/completions", json={})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


async def test_an_idle_stream_is_pinged(options: ProxyOptions,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens 0.4 s apart, pings after 0.1 s idle: pings between them, none at the end."""
    monkeypatch.setattr(answer, "PING_INTERVAL_S", 0.1)
    slow = Peer(options.runtime_dir, step_s=0.4).start()
    try:
        async with running_app(options) as app:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://p") as c:
                r = await c.post("/v1/messages", json={**ASK, "stream": True})
    finally:
        slow.stop()
    kinds = [e["type"] for e in sse_events(r.text)]
    deltas = [i for i, kind in enumerate(kinds) if kind == "content_block_delta"]
    assert len(deltas) == 3 and "ping" in kinds[deltas[0]:deltas[1]], kinds
    assert kinds[-2:] == ["message_delta", "message_stop"], kinds
