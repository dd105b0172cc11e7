"""The OpenAI Responses API's shapes: the Response object, the listed input items, and
Responses ``input`` turned into chat messages.

Application schema, built here from the typed records the daemon sends (StoredResponse) and
from the proxy's own live state; the daemon never sees these shapes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ipc.records import PLACEHOLDER_STATUSES, Message, ResponseStatus, StoredResponse, Usage

# Chat templates rarely know "developer"; it plays the same part as "system".
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PART_TYPES = ("input_text", "output_text")


class InputError(ValueError):
    """An invalid Responses ``input``; ``param`` names the offending field (``input[2].role``)."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"Invalid '{param}': {reason}")
        self.param = param


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


def _output_message(msg_id: str, status: ResponseStatus, text: str) -> dict[str, Any]:
    if status in (ResponseStatus.COMPLETED, ResponseStatus.INCOMPLETE):
        item_status = status.value
    elif status in PLACEHOLDER_STATUSES:
        item_status = "in_progress"
    else:  # cancelled or failed part-way: the text stops short
        item_status = "incomplete"
    return {
        "type": "message",
        "id": msg_id,
        "status": item_status,
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
) -> dict[str, Any]:
    """The wire object; ``output_text`` None means no output item (queued, in progress)."""
    status = ResponseStatus(status)
    output = []
    if output_text is not None:
        output.append(_output_message(output_id or message_id(id), status, output_text))
    incomplete_details = None
    if status is ResponseStatus.INCOMPLETE:
        incomplete_details = {"reason": incomplete_reason or "max_output_tokens"}
    return {
        "id": id,
        "object": "response",
        "created_at": created_at,
        "completed_at": completed_at,
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
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": top_p,
        "truncation": "disabled",
        "usage": None if usage is None else _usage_object(usage),
        "user": None,
    }


def stored_response_object(stored: StoredResponse) -> dict[str, Any]:
    """A stored response as GET and cancel answer with it."""
    return build_response(
        id=stored.id, status=stored.status, created_at=stored.created_at, model=stored.model,
        output_text=stored.output_text, usage=stored.usage, instructions=stored.instructions,
        previous_response_id=stored.previous_response_id, background=stored.background,
        store=True, error=stored.error, incomplete_reason=stored.incomplete_reason,
        temperature=stored.temperature, top_p=stored.top_p,
        max_output_tokens=stored.max_output_tokens, completed_at=stored.completed_at,
    )


def deleted_object(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InputError(f"{where}.content", "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise InputError(at, "must be an object")
        kind = part.get("type")
        if kind not in _TEXT_PART_TYPES:
            raise InputError(
                f"{at}.type", f"unsupported content part {kind!r}; only 'input_text' and "
                "'output_text' are accepted"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InputError(f"{at}.text", "must be a string")
        texts.append(text)
    # Parts are pieces of one message; concatenating keeps the text exactly as the client sent it.
    return "".join(texts)


def _item_message(item: Any, where: str) -> Message:
    if not isinstance(item, dict):
        raise InputError(where, "must be an object")
    kind = item.get("type", "message")
    if kind != "message":
        raise InputError(f"{where}.type", f"unsupported item type {kind!r}; only 'message' items "
                         "are accepted")
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise InputError(f"{where}.role", f"must be one of {', '.join(_ROLES)}; got {role!r}")
    if "content" not in item:
        raise InputError(f"{where}.content", "is required")
    return Message(_ROLES[role], _content_text(item["content"], where))


def input_items_to_messages(
    input: str | list[dict[str, Any]], instructions: str | None
) -> list[Message]:
    """Responses ``input`` (a string, or message items) as chat messages, instructions first."""
    messages = [Message("system", instructions)] if instructions else []
    if isinstance(input, str):
        messages.append(Message("user", input))
        return messages
    if not isinstance(input, list):
        raise InputError("input", "must be a string or a list of input items")
    if not input:
        raise InputError("input", "must not be an empty list")
    messages.extend(_item_message(item, f"input[{i}]") for i, item in enumerate(input))
    return messages


def input_item_objects(response_id: str, input_items: str) -> list[dict[str, Any]]:
    """A stored response's input items (the JSON text the client sent) as the API lists them:
    every item a message with an id (the client's, or one derived from the response id and the
    position) and typed parts."""
    stem = response_id.removeprefix("resp_")
    out = []
    for i, item in enumerate(msgspec.json.decode(input_items)):
        content = item.get("content")
        if isinstance(content, str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            content = [{"type": kind, "text": content}]
        out.append({"id": item.get("id") or f"msg_{stem}_{i}", "type": "message",
                    "role": item.get("role"), "status": item.get("status", "completed"),
                    "content": content})
    return out
