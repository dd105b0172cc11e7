"""The OpenAI Responses API's shapes: the Response object and a deleted response.

Application schema, built here from the typed records the daemon sends (StoredResponse) and
from the proxy's own live state; the daemon never sees these shapes. (Input items, in and out:
proxy/input_items.py.)
"""

from __future__ import annotations

from typing import Any

from ipc.records import PLACEHOLDER_STATUSES, ResponseStatus, StoredResponse, Usage


def message_id(response_id: str) -> str:
    """The id of a response's output message, derived so that every GET returns the same one."""
    return "msg_" + response_id.removeprefix("resp_")


def _usage_object(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def item_status(status: ResponseStatus) -> str:
    """The status of an output item that is still open when the response is in `status`."""
    if status in (ResponseStatus.COMPLETED, ResponseStatus.INCOMPLETE):
        return status.value
    if status in PLACEHOLDER_STATUSES:
        return "in_progress"
    return "incomplete"  # cancelled or failed part-way: the item stops short


def output_message(msg_id: str, status: ResponseStatus, text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": msg_id,
        "status": item_status(status),
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def build_response(
    *,
    id: str,
    status: ResponseStatus | str,
    created_at: int | float,
    model: str,
    output_text: str | None,
    usage: Usage | None,
    instructions: str | None,
    previous_response_id: str | None,
    background: bool,
    store: bool,
    error: str | None = None,
    output_id: str | None = None,
    incomplete_reason: str | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    max_output_tokens: int | None = None,
    completed_at: float | None = None,
    output: list[dict[str, Any]] | None = None,
    text: dict[str, Any] | None = None,
    conversation: str | None = None,
) -> dict[str, Any]:
    """The wire object; ``output_text`` None means no output item (queued, in progress), and
    ``output`` (the items) is the output in its place; ``text`` is the request's text config as
    echoed (free text when None)."""
    status = ResponseStatus(status)
    if output is None:
        output = []
        if output_text is not None:
            output.append(output_message(output_id or message_id(id), status, output_text))
    incomplete_details = None
    if status is ResponseStatus.INCOMPLETE:
        incomplete_details = {"reason": incomplete_reason or "max_output_tokens"}
    return {
        "id": id,
        "object": "response",
        "created_at": created_at,
        "completed_at": completed_at,
        "conversation": None if conversation is None else {"id": conversation},
        "status": status.value,
        "background": background,
        "error": None if error is None else {"code": "server_error", "message": error},
        "incomplete_details": incomplete_details,
        "instructions": instructions,
        "max_output_tokens": max_output_tokens,
        "metadata": {},
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": store,
        "temperature": temperature,
        "text": text or {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": top_p,
        "truncation": "disabled",
        "usage": None if usage is None else _usage_object(usage),
        "user": None,
    }


def stored_response_object(stored: StoredResponse,
                           text: dict[str, Any] | None = None) -> dict[str, Any]:
    """A stored response as GET and cancel answer with it (the store does not keep the
    request's text config: ``text`` where the proxy still knows it)."""
    return build_response(
        id=stored.id, status=stored.status, created_at=stored.created_at, model=stored.model,
        output_text=stored.output_text, usage=stored.usage, instructions=stored.instructions,
        previous_response_id=stored.previous_response_id, background=stored.background,
        store=True, error=stored.error, incomplete_reason=stored.incomplete_reason,
        temperature=stored.temperature, top_p=stored.top_p,
        max_output_tokens=stored.max_output_tokens, completed_at=stored.completed_at, text=text,
        conversation=stored.conversation,
    )


def deleted_object(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response.deleted", "deleted": True}
