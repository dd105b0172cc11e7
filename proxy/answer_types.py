"""The answers the API gives, as msgspec types: the OpenAPI document's schemas of them.

The handlers build answers as plain dicts; these types only describe them (proxy/openapi.py),
and tests/proxy/test_openapi.py checks real answers against the document.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

JSON = dict[str, Any]


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(msgspec.Struct, forbid_unknown_fields=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: JSON | None
    finish_reason: Literal["stop", "length"]
    token_ids: list[int] | None = None  # when the request asked for return_token_ids
    prompt_token_ids: list[int] | None = None  # echo with return_token_ids


class Completion(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CalledFunction(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str | None  # null: the message only calls tools
    tool_calls: list[ToolCall] | None = None


ChatFinish = Literal["stop", "length", "tool_calls"]


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: JSON | None
    finish_reason: ChatFinish
    token_ids: list[int] | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunkChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: JSON | None
    finish_reason: Literal["stop", "length"] | None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionChunk(msgspec.Struct):
    """One SSE event of a streamed completion; the last one (include_usage) has no choices;
    with continuous_usage_stats every one has its choice's usage so far."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class CalledFunctionPiece(msgspec.Struct):
    name: str | None = None  # in a call's first piece
    arguments: str | None = None  # the arguments' next piece of text


class ToolCallPiece(msgspec.Struct):
    """A streamed call: its first piece says the id, type and name, the others only add to its
    arguments."""

    index: int
    function: CalledFunctionPiece
    id: str | None = None
    type: Literal["function"] | None = None


class ChatDelta(msgspec.Struct):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallPiece] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: JSON | None
    finish_reason: ChatFinish | None
    token_ids: list[int] | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ResponseEvent(msgspec.Struct):
    """One SSE event of a streamed response (response.created ... response.completed, error)."""

    type: str
    sequence_number: int


class ResponseError(msgspec.Struct):
    code: str
    message: str


class ResponseObject(msgspec.Struct):
    id: str
    object: Literal["response"]
    created_at: int | float
    completed_at: float | None
    conversation: JSON | None  # {"id": ...} of the conversation it is a turn of
    status: Literal["queued", "in_progress", "completed", "cancelled", "failed", "incomplete"]
    background: bool
    error: ResponseError | None
    incomplete_details: JSON | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[JSON]
    previous_response_id: str | None
    store: bool
    temperature: float | None
    top_p: float | None
    usage: JSON | None


class DeletedResponse(msgspec.Struct):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class InputItem(msgspec.Struct):
    id: str
    type: Literal["message"]
    role: str
    status: str
    content: list[JSON]


class InputItemList(msgspec.Struct):
    object: Literal["list"]
    data: list[InputItem]
    first_id: str | None
    last_id: str | None
    has_more: bool


class Conversation(msgspec.Struct):
    id: str
    object: Literal["conversation"]
    created_at: int
    metadata: dict[str, str]


class DeletedConversation(msgspec.Struct):
    id: str
    object: Literal["conversation.deleted"]
    deleted: bool


class ModelCard(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelCard]


class Health(msgspec.Struct):
    status: Literal["ok", "unavailable"]
    version: str | None = None  # tether's release
    model: str | None = None
    max_model_len: int | None = None
    tensor_parallel_size: int | None = None  # ranks the daemon runs the model on
    # The model's sampling defaults a request that omits them gets (ipc.records.GenerationDefaults)
    generation_defaults: dict[str, float] | None = None
    reason: str | None = None
