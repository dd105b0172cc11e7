"""How a stored response lies in its row: free text as JSON strings, the bytes a row counts
against the store's bound, and the typed record a row becomes on the wire."""

from __future__ import annotations

from typing import Any

import msgspec

from ipc.records import Message, ToolCallFormat, Usage
from ipc.response_records import PLACEHOLDER_STATUSES, ResponseStatus, StoredResponse

# `status IN PLACEHOLDERS_SQL`: the rows whose session has not ended.
PLACEHOLDERS_SQL = "(" + ", ".join(sorted(f"'{s.value}'" for s in PLACEHOLDER_STATUSES)) + ")"

messages_decoder = msgspec.json.Decoder(list[Message])
_usage_decoder = msgspec.json.Decoder(Usage)


def json_text(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def text_bytes(messages: list[Message]) -> int:
    """The bytes of text messages render in a prompt (their contents: what the template writes
    as it was sent), the measure a stored history is checked by before it is read."""
    return sum([len(m.content.encode()) for m in messages if m.content])


def row_size(*texts: object) -> int:
    """The bytes a row's text columns hold (the `size` column: retention by bytes)."""
    return sum(len(t.encode()) for t in texts if isinstance(t, str))


def text_column(value: str | None) -> str | None:
    """Free text (model output, instructions, errors) as a JSON string: PostgreSQL's text type
    refuses NUL, which a model may well emit."""
    return None if value is None else json_text(value)


def from_text_column(value: str | None) -> str | None:
    return None if value is None else str(msgspec.json.decode(value))


def stored_response(row: Any) -> StoredResponse:
    return StoredResponse(
        id=row["id"],
        status=ResponseStatus(row["status"]),
        created_at=row["created_at"],
        model=row["model"],
        background=bool(row["background"]),
        completed_at=row["completed_at"],
        output_text=from_text_column(row["output_text"]),
        usage=None if row["usage"] is None else _usage_decoder.decode(row["usage"]),
        instructions=from_text_column(row["instructions"]),
        previous_response_id=row["previous_response_id"],
        error=from_text_column(row["error"]),
        incomplete_reason=row["incomplete_reason"],
        temperature=row["temperature"],
        top_p=row["top_p"],
        max_output_tokens=row["max_output_tokens"],
        conversation=row["conversation_id"],
        echo=row["echo"] or "{}",  # rows of earlier releases hold none
        tool_call_format=(None if row["tool_call_format"] is None
                          else ToolCallFormat(row["tool_call_format"])),
    )
