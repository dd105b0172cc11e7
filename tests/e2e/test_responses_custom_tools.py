"""Custom tools on /v1/responses (Codex CLI's freeform apply_patch) with the official openai client
against the real pair: a forced call is a custom_tool_call item whose input is free text, streamed
with its input events; its output comes back as a custom_tool_call_output item, in a stateless
history or after previous_response_id, and both are stored and listed with the input."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.e2e.test_chat_tools import MODEL
from tests.e2e.test_responses_tools import TOOLS
from tests.support.pair import Server

pytestmark = pytest.mark.timeout(240)

PATCH: Any = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
              "format": {"type": "text"}}
FORCED: Any = {"type": "custom", "name": "apply_patch"}
ASK = "Add a file hello.txt that says hi."


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _call(response: Any) -> Any:
    [call] = response.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch"
    assert call.id and call.call_id and isinstance(call.input, str)
    return call


def _answer(call: Any) -> dict[str, Any]:
    return {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done."}


def test_a_forced_custom_call_answered_after_previous_response_id(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input=ASK, tools=[*TOOLS, PATCH],
                                    tool_choice=FORCED, max_output_tokens=100)
    assert first.status == "completed"
    call = _call(first)
    assert client.responses.retrieve(first.id).output == first.output
    second = client.responses.create(model=MODEL, previous_response_id=first.id,
                                     input=[_answer(call)], tools=[*TOOLS, PATCH],
                                     max_output_tokens=8)
    assert second.status in ("completed", "incomplete")
    listed = list(client.responses.input_items.list(second.id, order="asc"))
    assert [(i.type, i.call_id) for i in listed] == [("custom_tool_call_output", call.call_id)]


def test_a_custom_call_and_its_output_in_a_stateless_history_are_stored(
        client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input=ASK, tools=[PATCH], tool_choice=FORCED,
                                    max_output_tokens=100, store=False)
    call = _call(first)
    history: list[Any] = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
                          _answer(call)]
    second = client.responses.create(model=MODEL, input=history, tools=[PATCH],
                                     tool_choice="none", max_output_tokens=8)
    assert [item.type for item in second.output] == ["message"]
    listed = list(client.responses.input_items.list(second.id, order="asc"))
    assert [i.type for i in listed] == ["message", "custom_tool_call", "custom_tool_call_output"]
    assert (listed[1].call_id, listed[1].input) == (call.call_id, call.input)  # type: ignore[union-attr]


def test_a_streamed_custom_call_is_the_item_of_the_response(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input=ASK, tools=[PATCH], stream=True,
                                          tool_choice=FORCED, max_output_tokens=100))
    assert events[-1].type == "response.completed"
    call = _call(events[-1].response)
    deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
    [done] = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert deltas == done.input == call.input and done.item_id == call.id
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(i.type, i.call_id) for i in added] == [("custom_tool_call", call.call_id)]
    assert [e.item for e in events if e.type == "response.output_item.done"] == [call]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_forced_grammar_format_is_refused_naming_it(client: openai.OpenAI) -> None:
    lark = {**PATCH, "format": {"type": "grammar", "syntax": "lark",
                                "definition": 'start: "*** Begin Patch"'}}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=ASK, tools=[lark], tool_choice=FORCED)
    assert info.value.param == "tools[0].format"
    auto = client.responses.create(model=MODEL, input=ASK, tools=[lark], max_output_tokens=8,
                                   store=False)
    assert auto.status in ("completed", "incomplete")
