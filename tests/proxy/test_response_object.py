from typing import Any

import pytest
from openai.types.responses import Response, ResponseOutputMessage

from ipc.records import PLACEHOLDER_STATUSES, Message, ResponseStatus, StoredResponse, Usage
from proxy.response_object import (
    InputError,
    build_response,
    input_item_objects,
    input_items_to_messages,
    stored_response_object,
)


def _build(status: ResponseStatus, output_text: str | None, **extra: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "id": "resp_abc",
        "status": status,
        "created_at": 1700000000,
        "model": "tiny",
        "output_text": output_text,
        "usage": Usage(5, 3) if output_text is not None else None,
        "instructions": "be brief",
        "previous_response_id": None,
        "background": False,
        "store": True,
    }
    fields.update(extra)
    return build_response(**fields)


@pytest.mark.parametrize("status", list(ResponseStatus))
def test_every_status_parses_with_the_openai_client(status: ResponseStatus) -> None:
    text = None if status in (ResponseStatus.QUEUED, ResponseStatus.IN_PROGRESS) else "hi"
    error = "boom" if status is ResponseStatus.FAILED else None
    parsed = Response.model_validate(_build(status, text, error=error))
    assert parsed.status == status.value
    assert parsed.id == "resp_abc"
    assert parsed.output_text == (text or "")
    assert (parsed.error is not None) == (status is ResponseStatus.FAILED)


@pytest.mark.parametrize("status", list(ResponseStatus))
def test_a_stored_response_parses_with_the_openai_client(status: ResponseStatus) -> None:
    text = None if status in PLACEHOLDER_STATUSES else "hi"
    stored = StoredResponse("resp_abc", status, 1700000000, "tiny", background=True,
                            output_text=text, usage=Usage(5, 3),
                            error="boom" if status is ResponseStatus.FAILED else None)
    parsed = Response.model_validate(stored_response_object(stored))
    assert (parsed.id, parsed.status, parsed.output_text) == ("resp_abc", status.value, text or "")
    assert parsed.store and parsed.background


def test_stored_input_items_are_listed_as_messages_with_ids() -> None:
    items = '[{"role": "user", "content": "hi"}, {"type": "message", "role": "assistant", ' \
        '"id": "msg_mine", "content": [{"type": "output_text", "text": "yo"}]}]'
    listed = input_item_objects("resp_abc", items)
    assert [(i["id"], i["role"], i["status"]) for i in listed] == [
        ("msg_abc_0", "user", "completed"), ("msg_mine", "assistant", "completed")]
    assert listed[0]["content"] == [{"type": "input_text", "text": "hi"}]


def test_completed_object_carries_usage_and_a_stable_message_id() -> None:
    body = _build(ResponseStatus.COMPLETED, "hello there")
    parsed = Response.model_validate(body)
    assert "output_text" not in body
    assert parsed.output_text == "hello there"
    message = parsed.output[0]
    assert isinstance(message, ResponseOutputMessage)
    assert message.id == "msg_abc"
    assert message.status == "completed"
    assert parsed.usage is not None
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens) == (5, 3)
    assert parsed.usage.total_tokens == 8
    assert parsed.incomplete_details is None


def test_explicit_output_id_is_used() -> None:
    body = _build(ResponseStatus.COMPLETED, "x", output_id="msg_custom")
    assert body["output"][0]["id"] == "msg_custom"


def test_no_output_item_without_output_text() -> None:
    body = _build(ResponseStatus.QUEUED, None, background=True)
    assert body["output"] == []
    assert body["usage"] is None
    assert body["background"] is True


def test_incomplete_names_its_reason() -> None:
    parsed = Response.model_validate(_build(ResponseStatus.INCOMPLETE, "cut"))
    assert parsed.incomplete_details is not None
    assert parsed.incomplete_details.reason == "max_output_tokens"
    assert isinstance(parsed.output[0], ResponseOutputMessage)
    assert parsed.output[0].status == "incomplete"


def test_status_given_as_string_is_checked() -> None:
    assert _build("completed", "x")["status"] == "completed"  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        _build("done", "x")  # type: ignore[arg-type]


def test_string_input_becomes_one_user_message_after_instructions() -> None:
    assert input_items_to_messages("hi", "be brief") == [
        Message("system", "be brief"),
        Message("user", "hi"),
    ]
    assert input_items_to_messages("hi", None) == [Message("user", "hi")]


def test_message_items_with_string_and_part_content() -> None:
    items: list[dict[str, Any]] = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "c", "annotations": []}]},
    ]
    assert input_items_to_messages(items, None) == [
        Message("system", "rules"),
        Message("user", "ab"),
        Message("assistant", "c"),
    ]


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([], "input"),
        ([{"role": "user"}], "input[0].content"),
        ([{"role": "tool", "content": "x"}], "input[0].role"),
        ([{"role": ["user"], "content": "x"}], "input[0].role"),
        ([{"role": "user", "content": "x"}, "hello"], "input[1]"),
        ([{"type": "function_call", "name": "f"}], "input[0].type"),
        ([{"role": "user", "content": 7}], "input[0].content"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}],
         "input[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "input_text"}]}], "input[0].content[0].text"),
    ],
)
def test_invalid_input_names_the_item_and_field(items: list[Any], param: str) -> None:
    with pytest.raises(ValueError) as info:
        input_items_to_messages(items, None)
    assert isinstance(info.value, InputError)
    assert info.value.param == param
    assert f"'{param}'" in str(info.value)


def test_input_that_is_neither_string_nor_list_is_rejected() -> None:
    with pytest.raises(InputError, match="'input'"):
        input_items_to_messages({"role": "user"}, None)  # type: ignore[arg-type]
