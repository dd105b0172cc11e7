"""The Messages API's answers as msgspec types: the OpenAPI document's schemas of them
(proxy/openapi.py). The handlers build them as plain dicts (proxy/anthropic/answer.py)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class AnthropicErrorDetail(msgspec.Struct):
    type: str  # invalid_request_error, authentication_error, not_found_error, ...
    message: str


class AnthropicError(msgspec.Struct):
    type: Literal["error"]
    error: AnthropicErrorDetail


class MessageUsage(msgspec.Struct):
    input_tokens: int  # the prompt's tokens the prefix cache did not hold
    output_tokens: int
    cache_read_input_tokens: int  # those it held
    cache_creation_input_tokens: int | None = None


class MessageObject(msgspec.Struct):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]  # text and tool_use blocks
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessageUsage


class MessageEvent(msgspec.Struct):
    """One SSE event of a streamed message: message_start, ping, content_block_start,
    content_block_delta, content_block_stop, message_delta, message_stop, or error."""

    type: str


class TokenCount(msgspec.Struct):
    input_tokens: int
