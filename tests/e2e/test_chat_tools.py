"""Tool calling on chat completions with the official openai client against the real pair: forced
calls (required, named) whose arguments validate, none, parallel_tool_calls false, a follow-up
turn with the tool's answer, and streamed calls reassembled exactly as the collected answer,
also when the stream's deltas are merged and paused by flow control."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.support.pair import Server, start_server

pytestmark = pytest.mark.timeout(240)

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
        "required": ["zone"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                      "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MODEL = "builtin:tiny"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _valid_calls(message: Any) -> list[Any]:
    calls = message.tool_calls or []
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


def test_required_calls_a_tool_with_valid_arguments(client: openai.OpenAI) -> None:
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, seed=seed,
                                           tool_choice="required", max_tokens=200)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and _valid_calls(choice.message)


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, n=3,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in r.choices:
        calls = _valid_calls(choice.message)
        assert [c.function.name for c in calls] == ["get_time"]
        assert choice.finish_reason == "tool_calls"


def test_parallel_false_is_one_call(client: openai.OpenAI) -> None:
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, seed=seed,
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=300, temperature=1.0)
        assert len(_valid_calls(r.choices[0].message)) == 1


def test_none_answers_in_text(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                       max_tokens=20)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_follow_up_turn_with_the_tools_answer(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           tool_choice="required", max_tokens=200)
    message = first.choices[0].message
    history: list[Any] = [*ASK, message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}
                for call in message.tool_calls or []]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=16)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage is not None and r.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


def _reassembled(chunks: Iterator[Any]) -> tuple[str | None, list[dict[str, str]], str | None]:
    """A stream's content and calls put back together; each call's id and name said once."""
    content: str | None = None
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for piece in delta.tool_calls or []:
                if piece.index not in calls:
                    assert piece.id and piece.function.name and piece.type == "function"
                    calls[piece.index] = {"id": piece.id, "name": piece.function.name,
                                          "arguments": piece.function.arguments or ""}
                else:
                    assert piece.id is None and piece.function.name is None
                    calls[piece.index]["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _calls(message: Any) -> list[dict[str, str]]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []]


def _compare_stream(client: openai.OpenAI, **request: Any) -> None:
    """The greedy stream of a forced call, reassembled, says what the collected answer says
    (but for the call ids, random per answer)."""
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0, **request}
    collected = client.chat.completions.create(**body).choices[0]
    content, calls, finish = _reassembled(client.chat.completions.create(**body, stream=True))
    assert finish == collected.finish_reason == "tool_calls"
    assert content == collected.message.content
    strip = [{k: v for k, v in c.items() if k != "id"} for c in calls]
    assert strip == [{k: v for k, v in c.items() if k != "id"} for c in _calls(collected.message)]
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_streamed_calls_reassemble_as_the_collected_answer(client: openai.OpenAI) -> None:
    _compare_stream(client, tool_choice="required", max_tokens=200)
    _compare_stream(client, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                    max_tokens=120)


def test_the_clients_stream_helper_parses_the_calls(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200,
                                        tool_choice="required") as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls" and _valid_calls(final.choices[0].message)


def test_open_objects_take_only_the_properties_they_list(client: openai.OpenAI) -> None:
    """A zero-argument tool as the `llm` CLI sends one, and parameters without
    additionalProperties: random weights forced to call them write no key nobody listed (before,
    `{"e>ف…": 0}`); a strict response format's objects likewise."""
    open_tools: list[Any] = [
        {"type": "function", "function": {"name": "now", "parameters": {
            "type": "object", "properties": {}}}},
        {"type": "function", "function": {"name": "where", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}}}}]
    for seed in range(12):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=open_tools, n=2,
                                           tool_choice="required", max_tokens=80, seed=seed,
                                           temperature=1.0, parallel_tool_calls=False)
        for choice in r.choices:
            [call] = choice.message.tool_calls or []
            arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
            listed = {"now": set(), "where": {"city"}}[call.function.name]  # type: ignore[union-attr]
            assert set(arguments) <= listed, (seed, call)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}}}
    strict = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                     "strict": True}}
    for seed in range(6):
        r = client.chat.completions.create(model=MODEL, messages=ASK, response_format=strict,  # type: ignore[arg-type]
                                           max_tokens=40, seed=seed, temperature=1.0, n=2)
        for choice in r.choices:
            assert set(json.loads(choice.message.content or "")) <= {"a"}, (seed, choice)


def test_a_streamed_call_turn_adds_up_to_the_collected_message(client: openai.OpenAI) -> None:
    """As OpenAI streams a tool-call turn: the first delta has the role and `content: null`, so
    the openai client's stream helper ends with the collected message's null content (before:
    "", from a first delta of `content: ""`)."""
    body: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0,
                            "tool_choice": "required", "max_tokens": 200}
    collected = client.chat.completions.create(**body).choices[0].message
    first = next(iter(client.chat.completions.create(**body, stream=True))).choices[0].delta
    assert first.role == "assistant" and first.content is None
    assert "content" in first.model_fields_set  # said, as null
    with client.chat.completions.stream(**body) as events:
        streamed = events.get_final_completion().choices[0].message
    assert collected.content is None and streamed.content is None
    assert [(c["name"], c["arguments"]) for c in _calls(streamed)] == [
        (c["name"], c["arguments"]) for c in _calls(collected)]


@pytest.fixture(scope="module")
def merging_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Deltas merged 8 tokens to an event, and paused by flow control after 4 unread."""
    s = start_server(tmp_path_factory.mktemp("e2e-merge"),
                     ["--stream-merge-tokens", "8", "--max-buffered-tokens", "4"])
    yield s
    s.stop()


def test_merged_and_paused_streams_reassemble_the_same(merging_server: Server) -> None:
    client = openai.OpenAI(base_url=merging_server.url + "/v1", api_key="unused", max_retries=0)
    body: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0,
                            "tool_choice": "required", "max_tokens": 200}
    collected = client.chat.completions.create(**body).choices[0].message
    slow = client.chat.completions.create(**body, stream=True,
                                          stream_options={"include_usage": True})
    seen: list[Any] = []

    def slowly() -> Iterator[Any]:
        for chunk in slow:
            time.sleep(0.02)  # the proxy holds what waits, pauses the daemon, merges the rest
            seen.append(chunk)
            yield chunk

    content, calls, finish = _reassembled(slowly())
    assert finish == "tool_calls" and content is None
    assert seen[-1].usage is not None and len(seen) < seen[-1].usage.completion_tokens / 2
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["name"], c["arguments"]) for c in _calls(collected)]


@pytest.mark.parametrize(("parser", "start"), [("llama3_json", '{"name": '),
                                               ("mistral", "[TOOL_CALLS][")])
def test_the_tool_call_parser_flag_picks_the_format(tmp_path_factory: pytest.TempPathFactory,
                                                    parser: str, start: str) -> None:
    s = start_server(tmp_path_factory.mktemp(f"e2e-{parser}"), ["--tool-call-parser", parser])
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, n=2,
                                           tool_choice="required", max_tokens=200,
                                           extra_body={"return_token_ids": True})
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls" and _valid_calls(choice.message)
            ids = (choice.model_extra or {})["token_ids"]
            assert bytes(i for i in ids if i < 256).decode().startswith(start)
            if parser == "mistral":  # the ids its templates take: 9 letters and digits
                assert all(len(c.id) == 9 and c.id.isalnum() for c in choice.message.tool_calls)
    finally:
        s.stop()
