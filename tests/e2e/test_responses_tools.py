"""Function tools on /v1/responses with the official openai client against the real pair: forced
calls are function_call items whose arguments validate, streamed as OpenAI streams them; their
outputs come back as function_call_output items, in a stateless history or after
previous_response_id, and are listed with the input; hosted tools are accepted, echoed and
never offered to the model."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.test_chat_tools import MODEL, SCHEMAS, TIME, WEATHER
from tests.support.pair import Server

pytestmark = pytest.mark.timeout(240)

TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "Weather now.",
     "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "parameters": TIME, "strict": False},
]
ASK = "What is the weather in Paris?"


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _calls(response: Any) -> list[Any]:
    calls = [item for item in response.output if item.type == "function_call"]
    for call in calls:
        assert call.id and call.call_id and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


def _answers(calls: list[Any]) -> list[Any]:
    return [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny, 21C"}
            for c in calls]


def test_a_required_call_then_its_output_in_a_stateless_history(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required",
                                    max_output_tokens=200, store=False)
    assert first.status == "completed"
    calls = _calls(first)
    assert calls and first.output_text == ""
    history: list[Any] = [{"role": "user", "content": ASK}, *first.output, *_answers(calls)]
    second = client.responses.create(model=MODEL, input=history, tools=TOOLS,
                                     tool_choice="none", max_output_tokens=8, store=False)
    assert second.status in ("completed", "incomplete")
    assert [item.type for item in second.output] == ["message"]


def test_a_named_call_answered_after_previous_response_id(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, max_output_tokens=200,
                                    tool_choice={"type": "function", "name": "get_time"})
    calls = _calls(first)
    assert [c.name for c in calls] == ["get_time"]
    # A GET answers with the same items and the request's settings, as OpenAI echoes them.
    stored = client.responses.retrieve(first.id)
    assert stored.status == "completed"
    assert [c.model_dump() for c in _calls(stored)] == [c.model_dump() for c in calls]
    assert stored.tool_choice.type == "function" and stored.tool_choice.name == "get_time"  # type: ignore[union-attr]
    assert [t.name for t in stored.tools] == ["get_weather", "get_time"]  # type: ignore[union-attr]
    second = client.responses.create(model=MODEL, previous_response_id=first.id,
                                     input=_answers(calls), tools=TOOLS, max_output_tokens=8)
    assert second.status in ("completed", "incomplete")
    listed = list(client.responses.input_items.list(second.id, order="asc"))
    assert [(i.type, i.call_id) for i in listed] == [("function_call_output", calls[0].call_id)]


def test_parallel_false_is_one_call(client: openai.OpenAI) -> None:
    for _ in range(3):
        r = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=300,
                                    temperature=1.0, store=False)
        assert len(_calls(r)) == 1


def test_streamed_calls_are_the_items_of_the_response(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input=ASK, tools=TOOLS, stream=True,
                                          tool_choice="required", max_output_tokens=200))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    calls = _calls(final)
    for index, call in enumerate(final.output):
        added = [e for e in events if e.type == "response.output_item.added"
                 and e.output_index == index]
        assert len(added) == 1 and added[0].item.call_id == call.call_id
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments"
                         ".delta" and e.output_index == index)
        done = [e for e in events if e.type == "response.function_call_arguments.done"
                and e.output_index == index]
        assert deltas == done[0].arguments == call.arguments
        item_done = [e.item for e in events if e.type == "response.output_item.done"
                     and e.output_index == index]
        assert item_done == [call]
    assert len(calls) == len(final.output)
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_hosted_tools_are_accepted_and_never_offered(client: openai.OpenAI) -> None:
    """As Codex CLI sends them; only forcing one is refused."""
    hosted: list[Any] = [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["v"]}]
    r = client.responses.create(model=MODEL, input=ASK, tools=[*hosted, *TOOLS],
                                tool_choice="required", max_output_tokens=200, store=False)
    assert {c.name for c in _calls(r)} <= {"get_weather", "get_time"}
    assert [t.type for t in r.tools] == ["web_search", "file_search", "function", "function"]
    alone = client.responses.create(model=MODEL, input=ASK, tools=hosted, max_output_tokens=8)
    assert [i.type for i in alone.output] == ["message"]
    assert client.responses.retrieve(alone.id).tools[1].vector_store_ids == ["v"]  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=ASK, tools=hosted, tool_choice="required")
    assert info.value.param == "tool_choice" and "web_search" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=ASK, tools=[*hosted, *TOOLS],
                                tool_choice={"type": "web_search_preview"})
    assert info.value.param == "tool_choice.type"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input=[{"type": "function_call_output",
                                                     "output": "x"}])


AGENTS: Any = {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "get_weather", "description": "Weather now.",
     "parameters": WEATHER, "strict": True, "defer_loading": False}]}


def test_a_namespace_call_names_its_namespace_and_comes_back_as_sent(
        client: openai.OpenAI) -> None:
    """As Codex CLI sends its sub-agent tools, with the fields it sends on every request."""
    first = client.responses.create(
        model=MODEL, input=ASK, tools=[AGENTS, {"type": "web_search"}], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=200, include=["reasoning.encrypted_content"],
        reasoning={"summary": "auto"}, extra_body={"client_metadata": {"session_id": "s-1"}})
    [call] = _calls(first)
    assert (call.namespace, call.name) == ("agents", "get_weather")
    assert client.responses.retrieve(first.id).output == first.output
    history: list[Any] = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
                          *_answers([call])]
    second = client.responses.create(model=MODEL, input=history, tools=[AGENTS],
                                     tool_choice="none", max_output_tokens=8, store=False)
    assert [item.type for item in second.output] == ["message"]


def test_a_streamed_namespace_call_names_its_namespace(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input=ASK, tools=[AGENTS], stream=True,
                                          tool_choice="required", max_output_tokens=200))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert events[-1].type == "response.completed"
    assert [(i.namespace, i.name) for i in added + done] == [("agents", "get_weather")] * (
        2 * len(done))
    assert done == _calls(events[-1].response)
