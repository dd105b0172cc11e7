"""The official anthropic client against the real pair: POST /v1/messages collected and streamed,
stop sequences, a tool-use loop with tool_result (the call forced by the grammar, so its input
validates), count_tokens, the prefix cache's hits as cache_read_input_tokens, the fields Claude
Code sends, and errors in Anthropic's shape as the client raises them, x-api-key auth too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import anthropic
import jsonschema
import pydantic
import pytest

from tests.support.pair import Server, assert_baseline, start_server
from tests.support.raw_http import sse_events
from tests.support.real_tokenizers import save_random_checkpoint

pytestmark = pytest.mark.timeout(240)

MODEL = "builtin:tiny"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
TOOLS: list[Any] = [{"name": "get_weather", "description": "Weather now.",
                     "input_schema": WEATHER}]


@pytest.fixture
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def _text(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_create_answers_a_message(client: anthropic.Anthropic, server: Server) -> None:
    m = client.messages.create(model=MODEL, max_tokens=8, messages=ASK,
                               extra_body={"temperature": 0})
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.id.startswith("msg_") and m.stop_reason in ("end_turn", "max_tokens")
    assert (m.stop_reason == "max_tokens") == (m.usage.output_tokens == 8)
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 5
    assert [b.type for b in m.content] in (["text"], [])
    assert_baseline(server.metrics())


def test_stream_says_what_create_says(client: anthropic.Anthropic, server: Server) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 24, "messages": ASK,
                            "extra_body": {"temperature": 0}}
    collected = client.messages.create(**body)
    with server.client() as c:  # every event as sent (the client passes pings over)
        raw = c.post("/v1/messages", json={**body.pop("extra_body"), **body, "stream": True})
    kinds = [e["type"] for e in sse_events(raw.text)]  # each `event:` its data's type
    assert kinds[:3] == ["message_start", "ping", "content_block_start"], kinds
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"], kinds
    body["extra_body"] = {"temperature": 0}
    with client.messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == _text(final) == _text(collected) and text
    assert final.stop_reason == collected.stop_reason
    assert final.usage.output_tokens == collected.usage.output_tokens


def test_a_stop_sequence_is_named(client: anthropic.Anthropic) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 32, "messages": ASK,
                            "extra_body": {"temperature": 0}}
    text = _text(client.messages.create(**body))
    assert len(text) > 12, text
    stop = text[8:11]
    m = client.messages.create(**body, stop_sequences=["\x00never", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert _text(m) == text[:text.index(stop)]


def test_a_tool_use_loop_with_tool_result(client: anthropic.Anthropic, server: Server) -> None:
    first = client.messages.create(model=MODEL, max_tokens=200, messages=ASK, tools=TOOLS,
                                   tool_choice={"type": "any"})
    assert first.stop_reason == "tool_use"
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER)
    history: list[Any] = [*ASK, {"role": "assistant", "content": first.content}, {
        "role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                     "content": "18 degrees, sunny"}]}]
    second = client.messages.create(model=MODEL, max_tokens=16, messages=history, tools=TOOLS,
                                    tool_choice={"type": "none"})
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in second.content)
    failed = [*history[:2], {"role": "user", "content": [{
        "type": "tool_result", "tool_use_id": call.id, "is_error": True,
        "content": [{"type": "text", "text": "no such city"}]}]}]
    assert client.messages.create(model=MODEL, max_tokens=4, messages=failed, tools=TOOLS).id
    assert_baseline(server.metrics())


def test_a_named_tool_streams_its_input(client: anthropic.Anthropic) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 200, "messages": ASK, "tools": TOOLS,
                            "extra_body": {"temperature": 0}, "tool_choice": {
                                "type": "tool", "name": "get_weather",
                                "disable_parallel_tool_use": True}}
    collected = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        pieces = [e.partial_json for e in stream if e.type == "input_json"]
        final = stream.get_final_message()
    [call] = final.content
    assert call.type == "tool_use" and final.stop_reason == "tool_use"
    assert json.loads("".join(pieces)) == call.input == collected.content[0].input
    jsonschema.validate(call.input, WEATHER)


class Weather(pydantic.BaseModel):
    city: str  # the client moves a maxLength into the description: Anthropic refuses it
    unit: Literal["celsius", "fahrenheit"]


def test_structured_outputs_parse_as_the_schema(client: anthropic.Anthropic,
                                                server: Server) -> None:
    """`messages.parse` with a pydantic model sends its schema as `output_config.format`; the
    answer's text is JSON of that schema, random weights or not, and the client parses it."""
    m = client.messages.parse(model=MODEL, max_tokens=64, messages=ASK, output_format=Weather,
                              output_config={"effort": "high"}, extra_body={"temperature": 1})
    assert isinstance(m.parsed_output, Weather), _text(m)
    offered = client.messages.create(  # with tools, the answer is a call or that JSON
        model=MODEL, max_tokens=64, messages=ASK, tools=TOOLS,
        output_config={"format": {"type": "json_schema", "schema": WEATHER}})
    for block in offered.content:
        if block.type == "text":
            jsonschema.validate(json.loads(block.text), WEATHER)
        else:
            assert block.type == "tool_use"
            jsonschema.validate(block.input, WEATHER)
    assert_baseline(server.metrics())


def test_count_tokens_counts_the_prompt(client: anthropic.Anthropic) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS,
                            "system": [{"type": "text", "text": "Be brief."}]}
    counted = client.messages.count_tokens(**body).input_tokens
    m = client.messages.create(**body, max_tokens=1)
    assert counted == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 20


def test_the_prefix_cache_is_read(client: anthropic.Anthropic) -> None:
    long = [{"role": "user", "content": "Tell me about the sea. " * 20}]
    client.messages.create(model=MODEL, max_tokens=1, messages=long)
    again = client.messages.create(model=MODEL, max_tokens=1, messages=long)
    assert (again.usage.cache_read_input_tokens or 0) >= 16 * 5, again.usage
    assert again.usage.input_tokens < 100, again.usage


def test_what_claude_code_sends_is_served(client: anthropic.Anthropic) -> None:
    """Its fields as Claude Code 2.1 sends them (docs/endpoints.md), max_tokens past the
    context a ceiling."""
    with client.messages.stream(
        model=MODEL, max_tokens=32000,
        system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
                {"type": "text", "text": "You are a Claude agent.",
                 "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "say hi"}]},
                  {"role": "system", "content": [{"type": "text", "text": "# Environment",
                                                  "cache_control": {"type": "ephemeral"}}]}],
        tools=[*TOOLS, {"name": "Deferred", "description": "never offered",
                        "input_schema": {"type": "object"}, "defer_loading": True}],
        metadata={"user_id": '{"device_id":"d"}'},
        extra_headers={"anthropic-beta": "claude-code-20250219,effort-2025-11-24"},
        extra_query={"beta": "true"},
        extra_body={"thinking": {"type": "adaptive", "display": "omitted"},
                    "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                                      "keep": "all"}]},
                    "output_config": {"effort": "high"}}) as stream:
        m = stream.get_final_message()
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    context = client.models.retrieve(MODEL).model_extra or {}
    used = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) + m.usage.output_tokens
    assert used <= context.get("max_model_len", 2048)


def _error(raised: pytest.ExceptionInfo[anthropic.APIStatusError]) -> dict[str, Any]:
    body = raised.value.body
    assert isinstance(body, dict) and body["type"] == "error", body
    return body["error"]  # type: ignore[no-any-return]


def test_errors_are_anthropic_shaped(client: anthropic.Anthropic, server: Server) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model=MODEL, max_tokens=4, messages=ASK,
                               extra_body={"frobnicate": 1})
    error = _error(raised)
    assert error["type"] == "invalid_request_error" and "frobnicate" in error["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "see"}, image]}])
    assert "'messages[0].content[1]' is an image block" in _error(raised)["message"]
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.post("/v1/messages", cast_to=object, body={"model": MODEL, "messages": ASK})
    assert "max_tokens" in _error(raised)["message"]
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model=MODEL, max_tokens=4, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert "thinking" in _error(raised)["message"]
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model=MODEL, max_tokens=4, messages=[
            *ASK, {"role": "assistant", "content": "It is"}])
    assert "prefilling" in _error(raised)["message"]
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="claude-opus-4", max_tokens=4, messages=ASK)
    assert _error(raised)["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.count_tokens(model=MODEL, messages=[
            {"role": "user", "content": [image]}])
    assert "image block" in _error(raised)["message"]
    assert_baseline(server.metrics())


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("e2e-anthropic-key"), api_key="sk-test")
    yield s
    s.stop()


def test_x_api_key_is_the_key(keyed: Server) -> None:
    good = anthropic.Anthropic(base_url=keyed.url, api_key="sk-test", max_retries=0)
    assert good.messages.create(model=MODEL, max_tokens=2, messages=ASK).id
    bad = anthropic.Anthropic(base_url=keyed.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as raised:
        bad.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert _error(raised)["type"] == "authentication_error"


def test_a_system_turn_joins_the_system_prompt(tmp_path: Path) -> None:
    """Claude Code's environment comes as a system-role message after the user's turn; Mistral's
    template refuses a system message anywhere but first, so it joins the system prompt."""
    checkpoint = save_random_checkpoint("spm", tmp_path / "mistral-ckpt", end_scale=5.0)
    (tmp_path / "pair").mkdir()
    s = start_server(tmp_path / "pair", ["--model", str(checkpoint)])
    try:
        client = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0)
        m = client.messages.create(
            model="mistral-ckpt", max_tokens=8, system="You are an agent.",
            messages=[{"role": "user", "content": "say hi"},
                      {"role": "system", "content": [{"type": "text", "text": "# Environment"}]}])
        assert m.stop_reason in ("end_turn", "max_tokens")
    finally:
        s.stop()
