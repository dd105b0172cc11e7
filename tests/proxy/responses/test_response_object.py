from typing import Any

import pytest
from openai.types.responses import Response, ResponseOutputMessage

from ipc.records import Usage
from ipc.response_records import PLACEHOLDER_STATUSES, ResponseStatus, StoredResponse
from proxy.responses.response_object import build_response, stored_response_object


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
