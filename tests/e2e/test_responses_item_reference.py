"""item_reference input items with the official openai client against the real pair: a stored
response's function_call, named by its id in the next turn's input beside its output, is the
call itself (streamed or not, and listed so); an id the store does not hold is a 400."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.e2e.test_chat_tools import MODEL
from tests.e2e.test_responses_tools import ASK, TOOLS, _answers, _calls, client  # noqa: F401

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stored_call_referenced_by_id_beside_its_output(client: openai.OpenAI,  # noqa: F811
                                                          stream: bool) -> None:
    first = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required",
                                    max_output_tokens=200)
    calls = _calls(first)
    history: list[Any] = [{"role": "user", "content": ASK},
                          *[{"type": "item_reference", "id": c.id} for c in calls],
                          *_answers(calls)]
    kwargs: dict[str, Any] = {"model": MODEL, "input": history, "tools": TOOLS,
                              "tool_choice": "none", "max_output_tokens": 8}
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        assert events[-1].type in ("response.completed", "response.incomplete")
        second = events[-1].response  # type: ignore[union-attr]
    else:
        second = client.responses.create(**kwargs)
    assert second.status in ("completed", "incomplete")
    assert [item.type for item in second.output] == ["message"]
    listed = list(client.responses.input_items.list(second.id, order="asc"))
    assert [i.type for i in listed] == ["message", *["function_call"] * len(calls),
                                        *["function_call_output"] * len(calls)]
    assert [(i.id, i.call_id, i.arguments) for i in listed[1:1 + len(calls)]] == [
        (c.id, c.call_id, c.arguments) for c in calls]  # type: ignore[union-attr]


def test_an_unknown_id_is_a_400_naming_it(client: openai.OpenAI) -> None:  # noqa: F811
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, max_output_tokens=8, input=[
            {"role": "user", "content": ASK}, {"type": "item_reference", "id": "fc_unknown"}])
    assert info.value.body["param"] == "input[1].id"  # type: ignore[index]
    assert "fc_unknown" in info.value.body["message"]  # type: ignore[index]
