"""POST /v1/responses bodies: validation, and the Submit they become.

The body is decoded into typed, bounded fields in one call into msgspec (proxy/input_items.py:
a malformed or oversized item, or a field the server does not know, is a 400 naming it); the
proxy turns the input into chat messages, the daemon puts instructions and the previous
response's history before them and stores the items, as validated, for listing.
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec

from ipc.records import Message, NonNegInt, RequestKind, ResponseFields, SamplingParams, Submit
from proxy.errors import ApiError
from proxy.input_items import (
    InputItem,
    NonEmptyItems,
    explain_unsupported,
    stored_items,
    to_messages,
)
from proxy.responses_events import ResponseParams
from proxy.schemas import (
    REQUEST_ID_PATTERN,
    PositiveInt,
    Temperature,
    TopP,
    check_max_tokens,
    check_model,
    decode_body,
)

# OpenAI's bounds on metadata: 16 pairs, keys of 64 characters, values of 512.
Metadata = Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)],
                          Annotated[str, msgspec.Meta(max_length=512)]],
                     msgspec.Meta(max_length=16)]
# Any id this server hands out: a longer one cannot name a stored response.
ResponseId = Annotated[str, msgspec.Meta(pattern=REQUEST_ID_PATTERN)]

class ConversationRef(msgspec.Struct):
    id: ResponseId


class CreateResponse(msgspec.Struct):
    input: str | NonEmptyItems
    model: str | None = None
    instructions: str | None = None
    previous_response_id: ResponseId | None = None
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
    metadata: Metadata | None = None
    # The conversation this is a turn of: its id, or {"id": ...}.
    conversation: ResponseId | ConversationRef | None = None

    @property
    def conversation_id(self) -> str | None:
        c = self.conversation
        return c.id if isinstance(c, ConversationRef) else c


def decode_request(body: bytes, served: tuple[str, ...]) -> tuple[CreateResponse, list[Message]]:
    """The validated body and its input as chat messages; ApiError(400) naming the offending
    field otherwise."""
    try:
        req = decode_body(body, CreateResponse)
    except ApiError as exc:
        raise explain_unsupported(exc) from None
    check_model(req.model, served)
    if req.background and not req.store:
        raise ApiError(400, "'background' requires 'store' to be true: a background response "
                       "is fetched from the store", param="background", code="invalid_value")
    if req.conversation is not None:
        check_conversation(req)
    return req, to_messages(req.input)


def check_conversation(req: CreateResponse) -> None:
    if req.previous_response_id is not None:
        raise ApiError(400, "'conversation' and 'previous_response_id' cannot both be given: "
                       "a conversation holds its own history", param="conversation",
                       code="invalid_value")
    if not req.store:
        raise ApiError(400, "'conversation' requires 'store' to be true: a turn joins its "
                       "conversation from the store", param="store", code="invalid_value")


def conversation_input(input: str | list[InputItem]) -> tuple[list[Message], list[int]]:
    """The input as messages, and how many of them each item renders as (a conversation keeps
    each item with its own)."""
    if isinstance(input, str):
        return to_messages(input), [1]
    groups = [to_messages([item]) for item in input]
    return [m for group in groups for m in group], [len(group) for group in groups]


def response_params(req: CreateResponse, rid: str, model: str,
                    sampling: SamplingParams) -> ResponseParams:
    return ResponseParams(
        id=rid, created_at=int(time.time()), model=model, instructions=req.instructions,
        previous_response_id=req.previous_response_id, background=req.background,
        store=req.store, temperature=sampling.temperature, top_p=sampling.top_p,
        max_output_tokens=req.max_output_tokens, conversation=req.conversation_id,
    )


def sampling_params(req: CreateResponse, max_model_len: int | None) -> SamplingParams:
    """An omitted max_output_tokens is the rest of the context (None: the daemon resolves it)."""
    max_tokens = req.max_output_tokens
    check_max_tokens(max_tokens, req.min_tokens, "max_output_tokens", max_model_len)
    return SamplingParams(max_tokens=max_tokens,
                          temperature=1.0 if req.temperature is None else req.temperature,
                          top_p=1.0 if req.top_p is None else req.top_p,
                          ignore_eos=req.ignore_eos, min_tokens=req.min_tokens)


def build_submit(req: CreateResponse, messages: list[Message], params: ResponseParams,
                 sampling: SamplingParams, t_submit: float,
                 client_id: str | None = None) -> Submit:
    spans: list[int] = []
    if req.conversation is not None:
        messages, spans = conversation_input(req.input)
    fields = ResponseFields(store=req.store, background=req.background,
                            previous_response_id=req.previous_response_id,
                            instructions=req.instructions, input=messages,
                            input_items=stored_items(req.input),
                            created_at=params.created_at, model=params.model,
                            conversation=req.conversation_id, input_spans=spans)
    return Submit(rid=params.id, kind=RequestKind.RESPONSE, sampling=sampling,
                  n=1, messages=[], response=fields, t_submit=t_submit, client_id=client_id)

