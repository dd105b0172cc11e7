"""POST /v1/responses bodies: validation, and the Submit they become.

The body is decoded into typed, bounded fields in one call into msgspec (proxy/responses/input_items.py:
a malformed or oversized item, or a field the server does not know, is a 400 naming it); the
proxy turns the input into chat messages, the daemon puts instructions and the previous
response's history before them and stores the items, as validated, for listing.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, NamedTuple

import msgspec

from ipc.records import (
    GenerationDefaults,
    Message,
    NonNegInt,
    RequestKind,
    ResponseFields,
    SamplingParams,
    Submit,
    ToolCallFormat,
)
from proxy.bodies import REQUEST_ID_PATTERN, check_model, decode_body
from proxy.fields import (
    CACHE_HINT,
    END_USER,
    LATENCY_HINT,
    NO_PRIORITY,
    honoured,
    no_op,
    refused,
)
from proxy.guides import FORMAT_NOTE, TextConfig, text_echo, text_guide
from proxy.http.errors import ApiError
from proxy.openai.schemas import (
    MinP,
    PositiveInt,
    RepetitionPenalty,
    SpeculativeTokens,
    Temperature,
    TopK,
    TopP,
    check_max_tokens,
    model_sampling,
)
from proxy.openai.tool_requests import (
    PARALLEL_NOTE,
    TOOLS_NOTE,
    ResponsesTool,
    ResponsesToolChoice,
    responses_tool_use,
    tool_guide,
)
from proxy.responses.events import ResponseParams
from proxy.responses.input_items import (
    InputItem,
    ItemReference,
    NonEmptyRaws,
    decode_input,
    stored_items,
    to_messages,
)
from proxy.tool_calls import ToolUse

# OpenAI's bounds on metadata: 16 pairs, keys of 64 characters, values of 512.
Metadata = Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)],
                          Annotated[str, msgspec.Meta(max_length=512)]],
                     msgspec.Meta(max_length=16)]
# Any id this server hands out: a longer one cannot name a stored response.
ResponseId = Annotated[str, msgspec.Meta(pattern=REQUEST_ID_PATTERN)]

# `reasoning` values that ask for nothing: no effort, or a summary of reasoning that never is.
NO_REASONING = ({}, {"effort": "none"}, *(
    {**effort, "summary": summary} for effort in ({}, {"effort": "none"})
    for summary in ("auto", "concise", "detailed", "none")))


class ConversationRef(msgspec.Struct, forbid_unknown_fields=True):
    id: ResponseId


class ResponseStreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_obfuscation: Annotated[bool | None, no_op(
        "events are never padded here", False)] = None


class CreateResponse(msgspec.Struct, forbid_unknown_fields=True):
    """The marks: see proxy/fields.py."""

    input: str | NonEmptyRaws  # each item decoded on its own (proxy/responses/input_items.py)
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
    # vLLM's sampling extensions, which routers (smg) send on every request.
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    num_speculative_tokens: SpeculativeTokens = None
    priority: Annotated[Any, refused(NO_PRIORITY, 1, (0,))] = None
    user: Annotated[str | None, no_op(END_USER,
                                      "user-1")] = None
    metadata: Metadata | None = None  # stored with the response and echoed
    client_metadata: Annotated[dict[str, str] | None, no_op(
        "the client's own labels of the request (Codex CLI's session and turn ids)",
        {"session_id": "s-1"})] = None
    stream_options: ResponseStreamOptions | None = None
    prompt_cache_key: Annotated[str | None, no_op(CACHE_HINT, "k")] = None
    prompt_cache_retention: Annotated[str | None, no_op(CACHE_HINT, "24h")] = None
    prompt_cache_options: Annotated[dict[str, Any] | None, no_op(CACHE_HINT, {})] = None
    safety_identifier: Annotated[str | None, no_op(
        END_USER, "u-1")] = None
    service_tier: Annotated[str | None, no_op(LATENCY_HINT, "auto")] = None
    tools: Annotated[list[ResponsesTool] | None, honoured(TOOLS_NOTE)] = None
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: Annotated[bool | None, honoured(PARALLEL_NOTE)] = None
    max_tool_calls: Annotated[Any, refused("the number of calls is not capped", 3)] = None
    # The output's format (proxy/guides.py).
    text: Annotated[TextConfig | None, honoured(FORMAT_NOTE)] = None
    # Codex CLI asks for its reasoning items' encrypted content and for reasoning summaries on
    # every request: of a model that does not reason, both are nothing, so both ask for nothing.
    include: Annotated[Any, refused("nothing more can be included",
                                    ["message.output_text.logprobs"],
                                    ([], ["reasoning.encrypted_content"]))] = None
    reasoning: Annotated[Any, refused("no model served here reasons", {"effort": "high"},
                                      NO_REASONING)] = None
    truncation: Annotated[Any, refused("an input longer than the context is refused, not cut",
                                       "auto", ("disabled",))] = None
    top_logprobs: Annotated[Any, refused("log-probabilities are not returned here", 5,
                                         (0,))] = None
    # The conversation this is a turn of: its id, or {"id": ...}.
    conversation: ResponseId | ConversationRef | None = None
    prompt: Annotated[Any, refused("stored prompt templates are not served", {"id": "p"})] = None
    context_management: Annotated[Any, refused("the context is not compacted", [{}])] = None
    background_options: Annotated[Any, refused("not served", {})] = None
    access_programs: Annotated[Any, refused("not served", [])] = None
    image: Annotated[Any, refused("only text is generated", {})] = None
    moderation: Annotated[Any, refused("no moderation is run", {})] = None

    @property
    def conversation_id(self) -> str | None:
        c = self.conversation
        return c.id if isinstance(c, ConversationRef) else c


class Decoded(NamedTuple):
    """A request body, validated: its input as chat messages and its items as stored."""

    req: CreateResponse
    messages: list[Message]
    items: str  # JSON text of the items, as the store keeps them
    spans: list[int]  # a conversation turn's: how many of `messages` each item renders as
    tools: list[msgspec.Raw] | None  # as sent, for the echo (a hosted tool's own fields too)


class _SentTools(msgspec.Struct):
    """The body's tools as the client wrote them: CreateResponse keeps only what a function tool
    says, and the Response object echoes every tool as it was sent."""

    tools: list[msgspec.Raw] | None = None


def parse_request(body: bytes, served: tuple[str, ...]
                  ) -> tuple[CreateResponse, str | list[InputItem | ItemReference]]:
    """The validated body and its input items, item references still to resolve
    (proxy/responses/item_references.py); ApiError(400) naming the offending field otherwise."""
    req = decode_body(body, CreateResponse)
    items = req.input if isinstance(req.input, str) else decode_input(req.input)
    check_model(req.model, served)
    if req.background and not req.store:
        raise ApiError(400, "'background' requires 'store' to be true: a background response "
                       "is fetched from the store", param="background", code="invalid_value")
    return req, items


def decode_request(body: bytes, req: CreateResponse, items: str | list[InputItem]) -> Decoded:
    """The request parsed (`parse_request`), its input resolved: as messages and as stored."""
    if req.conversation is not None:
        check_conversation(req)
        messages, spans = conversation_input(items)
    else:
        messages, spans = to_messages(items), []
    sent = msgspec.json.decode(body, type=_SentTools).tools  # the body is valid JSON by now
    return Decoded(req, messages, stored_items(items), spans, sent)


def tool_use(req: CreateResponse, single: bool = False) -> ToolUse | None:
    """The request's tools; `single`: the chat template takes one call a turn."""
    return responses_tool_use(req.tools, req.tool_choice, req.parallel_tool_calls, single)


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


# What the Response object echoes of its request, when the request gave it (the rest: the
# object's defaults, proxy/responses/response_object.py).
_ECHOED = ("tools", "tool_choice", "parallel_tool_calls", "metadata", "truncation", "reasoning",
           "user", "safety_identifier", "prompt_cache_key", "top_logprobs")


def request_echo(decoded: Decoded, single: bool = False) -> dict[str, Any]:
    """`single`: the chat template takes one call a turn, which the echo says as
    ``parallel_tool_calls: false`` (and a stored response's output is parsed again so)."""
    # Through JSON: the tools are kept as the client's raw JSON.
    req = decoded.req
    echo = {name: msgspec.json.decode(msgspec.json.encode(
                decoded.tools if name == "tools" else getattr(req, name)))
            for name in _ECHOED if getattr(req, name) is not None}
    echo["text"] = text_echo(req.text)
    if single and req.tools:
        echo["parallel_tool_calls"] = False
    return echo


def response_params(decoded: Decoded, rid: str, model: str, sampling: SamplingParams,
                    single: bool = False) -> ResponseParams:
    req = decoded.req
    return ResponseParams(
        id=rid, created_at=int(time.time()), model=model, instructions=req.instructions,
        previous_response_id=req.previous_response_id, background=req.background,
        store=req.store, temperature=sampling.temperature, top_p=sampling.top_p,
        max_output_tokens=req.max_output_tokens, echo=request_echo(decoded, single),
        conversation=req.conversation_id,
    )


def sampling_params(req: CreateResponse, max_model_len: int | None,
                    defaults: GenerationDefaults | None = None) -> SamplingParams:
    """An omitted max_output_tokens is the rest of the context (None: the daemon resolves it);
    omitted sampling fields take the model's defaults, else the API's."""
    max_tokens = req.max_output_tokens
    check_max_tokens(max_tokens, req.min_tokens, "max_output_tokens", max_model_len)
    return SamplingParams(max_tokens=max_tokens, **model_sampling(req, defaults),
                          ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
                          guide=text_guide(req.text))


def build_submit(decoded: Decoded, params: ResponseParams, sampling: SamplingParams,
                 t_submit: float, client_id: str | None = None, use: ToolUse | None = None,
                 fmt: ToolCallFormat = ToolCallFormat.HERMES, tenant: str = "") -> Submit:
    """The Submit; `use` the request's tools, `fmt` how the model writes its calls, `tenant`
    whose it is in the store (proxy/http/tenancy.py)."""
    req = decoded.req
    if use is not None:
        sampling = msgspec.structs.replace(sampling, guide=tool_guide(use, fmt, sampling.guide))
    fields = ResponseFields(store=req.store, background=req.background,
                            previous_response_id=req.previous_response_id,
                            instructions=req.instructions, input=decoded.messages,
                            input_items=decoded.items, created_at=params.created_at,
                            model=params.model,
                            tool_call_format=fmt if use is not None and use.parsed else None,
                            conversation=req.conversation_id, input_spans=decoded.spans,
                            echo=msgspec.json.encode(params.echo or {}).decode(),
                            tenant=tenant)
    return Submit(rid=params.id, kind=RequestKind.RESPONSE, sampling=sampling,
                  n=1, messages=[], response=fields, t_submit=t_submit, client_id=client_id,
                  tools=list(use.tools) if use is not None else [])

