"""The OpenAI Responses API's shapes: the Response object and a deleted response.

Application schema, built here from the typed records the daemon sends (StoredResponse) and
from the proxy's own live state; the daemon never sees these shapes. (Input items, in and out:
proxy/responses/input_items.py.)
"""

from __future__ import annotations

from typing import Any

import msgspec

from ipc.records import Usage
from ipc.response_records import (
    PLACEHOLDER_STATUSES,
    SHUTDOWN_REASON,
    ResponseStatus,
    StoredResponse,
)


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


# The request fields a Response object echoes, as OpenAI answers when the request left them out.
ECHO_DEFAULTS: dict[str, Any] = {
    "metadata": {}, "parallel_tool_calls": True, "reasoning": {"effort": None, "summary": None},
    "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
    "truncation": "disabled", "user": None,
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
    echo: dict[str, Any] | None = None,
    conversation: str | None = None,
) -> dict[str, Any]:
    """The wire object; ``output_text`` None means no output item (queued, in progress), and
    ``output`` (the items) is the output in its place; ``echo`` what the request gave of the
    fields the object echoes (the rest: their defaults)."""
    status = ResponseStatus(status)
    if output is None:
        output = []
        if output_text is not None:
            output.append(output_message(output_id or message_id(id), status, output_text))
    incomplete_details = None
    if status is ResponseStatus.INCOMPLETE:
        # OpenAI's reasons name none for a server that stopped: its reason is null.
        incomplete_details = {"reason": None if incomplete_reason == SHUTDOWN_REASON
                              else incomplete_reason or "max_output_tokens"}
    return {
        "id": id,
        "object": "response",
        "created_at": int(created_at),
        "completed_at": None if completed_at is None else int(completed_at),
        "conversation": None if conversation is None else {"id": conversation},
        "status": status.value,
        "background": background,
        "error": None if error is None else {"code": "server_error", "message": error},
        "incomplete_details": incomplete_details,
        "instructions": instructions,
        "max_output_tokens": max_output_tokens,
        "model": model,
        "output": output,
        "previous_response_id": previous_response_id,
        "store": store,
        "temperature": temperature,
        "top_p": top_p,
        "usage": None if usage is None else _usage_object(usage),
        **ECHO_DEFAULTS,
        **(echo or {}),
    }


def stored_response_object(stored: StoredResponse,
                           output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A stored response as GET and cancel answer with it; ``output`` its items where they are
    more than its text (tool calls: proxy/responses/events.py)."""
    return build_response(
        id=stored.id, status=stored.status, created_at=stored.created_at, model=stored.model,
        output_text=stored.output_text, usage=stored.usage, instructions=stored.instructions,
        previous_response_id=stored.previous_response_id, background=stored.background,
        store=True, error=stored.error, incomplete_reason=stored.incomplete_reason,
        temperature=stored.temperature, top_p=stored.top_p,
        max_output_tokens=stored.max_output_tokens, completed_at=stored.completed_at,
        output=output, echo=msgspec.json.decode(stored.echo),
        conversation=stored.conversation,
    )


def deleted_object(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response.deleted", "deleted": True}
