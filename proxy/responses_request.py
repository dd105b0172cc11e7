"""POST /v1/responses bodies: validation, and the Submit they become.

The proxy turns the input into chat messages here (a malformed item is a 400 naming it); the
daemon puts instructions and the previous response's history before them, and stores the items
as they came for listing.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from ipc.records import Message, NonNegInt, RequestKind, ResponseFields, SamplingParams, Submit
from proxy.errors import ApiError
from proxy.response_object import InputError, input_items_to_messages
from proxy.responses_events import ResponseParams
from proxy.schemas import (
    DEFAULT_MAX_TOKENS,
    PositiveInt,
    Temperature,
    TopP,
    check_model,
    decode_body,
)

# A message item needs four levels (item, content list, part, text); the rest of the input is
# stored and echoed as it came, and JSON nested hundreds deep would exhaust the encoders' stack.
MAX_ITEM_DEPTH = 16


def _nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether lists and objects nest more than `limit` levels; iterative, so never recursion."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(
            item, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


class CreateResponse(msgspec.Struct):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    # Extensions (vLLM's names): generate past EOS, or at least this many tokens.
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    # Accepted for compatibility, not acted on.
    user: str | None = None
    metadata: dict[str, str] | None = None


def decode_request(body: bytes, served: tuple[str, ...]) -> tuple[CreateResponse, list[Message]]:
    """The validated body and its input as chat messages; ApiError(400) naming the offending
    field otherwise."""
    req = decode_body(body, CreateResponse)
    check_model(req.model, served)
    try:
        messages = input_items_to_messages(req.input, None)
    except InputError as exc:
        raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
    if isinstance(req.input, list):
        for i, item in enumerate(req.input):
            if _nested_deeper_than(item, MAX_ITEM_DEPTH):
                raise ApiError(400, f"'input[{i}]' is nested more than {MAX_ITEM_DEPTH} levels "
                               "deep", param=f"input[{i}]", code="invalid_value")
    if req.background and not req.store:
        raise ApiError(400, "'background' requires 'store' to be true: a background response "
                       "is fetched from the store", param="background", code="invalid_value")
    return req, messages


def response_params(req: CreateResponse, rid: str, model: str,
                    sampling: SamplingParams) -> ResponseParams:
    return ResponseParams(
        id=rid, created_at=int(time.time()), model=model, instructions=req.instructions,
        previous_response_id=req.previous_response_id, background=req.background,
        store=req.store, temperature=sampling.temperature, top_p=sampling.top_p,
        max_output_tokens=req.max_output_tokens,
    )


def sampling_params(req: CreateResponse, max_model_len: int | None) -> SamplingParams:
    max_tokens = req.max_output_tokens
    if max_tokens is None:
        # The proxy cannot count prompt tokens: "the rest of the context" is not an option.
        max_tokens = DEFAULT_MAX_TOKENS["chat"]
        if max_model_len is not None:
            max_tokens = min(max_tokens, max_model_len)
    elif max_model_len is not None and max_tokens > max_model_len:
        raise ApiError(400, f"'max_output_tokens' is {max_tokens}, more than the model's "
                       f"context length {max_model_len}", param="max_output_tokens",
                       code="context_length_exceeded")
    if req.min_tokens > max_tokens:
        raise ApiError(400, f"'min_tokens' ({req.min_tokens}) must be <= 'max_output_tokens' "
                       f"({max_tokens})", param="min_tokens", code="invalid_value")
    return SamplingParams(max_tokens=max_tokens,
                          temperature=1.0 if req.temperature is None else req.temperature,
                          top_p=1.0 if req.top_p is None else req.top_p,
                          ignore_eos=req.ignore_eos, min_tokens=req.min_tokens)


def build_submit(req: CreateResponse, messages: list[Message], params: ResponseParams,
                 sampling: SamplingParams, t_submit: float,
                 client_id: str | None = None) -> Submit:
    items = ([{"type": "message", "role": "user", "content": req.input}]
             if isinstance(req.input, str) else req.input)
    fields = ResponseFields(store=req.store, background=req.background,
                            previous_response_id=req.previous_response_id,
                            instructions=req.instructions, input=messages,
                            input_items=msgspec.json.encode(items).decode(),
                            created_at=params.created_at, model=params.model)
    return Submit(rid=params.id, kind=RequestKind.RESPONSE, sampling=sampling,
                  n=1, messages=[], response=fields, t_submit=t_submit, client_id=client_id)

