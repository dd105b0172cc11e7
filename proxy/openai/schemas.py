"""Request bodies of the completions and chat routes, validated by msgspec while decoding.

Limits live in the types (``Meta(ge=1)``) so msgspec's error names the field and the limit;
`decode_body` turns its "at `$.field`" path into the OpenAI ``param``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Protocol, TypeVar

import msgspec

from ipc.records import MAX_LOGPROBS, GenerationDefaults, Message, SamplingParams, ToolCall
from proxy.fields import (
    CACHE_HINT,
    END_USER,
    LATENCY_HINT,
    NO_PRIORITY,
    honoured,
    no_op,
    refused,
)
from proxy.guides import GuidedFields, request_guide
from proxy.http.errors import ApiError
from proxy.openai.tool_requests import PARALLEL_NOTE, TOOLS_NOTE, ChatTool, ChatToolChoice

T = TypeVar("T")

MAX_N = 128
MAX_PROMPTS = 256
MAX_STOP = 16
MAX_SEED = 2**63 - 1
MAX_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS
MAX_LOGIT_BIAS = 1024

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=-1)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0)]
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Seed = Annotated[int, msgspec.Meta(ge=-MAX_SEED, le=MAX_SEED)]
Stop = str | Annotated[list[str], msgspec.Meta(max_length=MAX_STOP)]
N = Annotated[int, msgspec.Meta(ge=1, le=MAX_N)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
TokenIds = Annotated[list[TokenId], msgspec.Meta(min_length=1)]
# OpenAI's keys are token ids written as strings ("50256"); msgspec reads them as ints.
LogitBias = Annotated[dict[int, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]],
                      msgspec.Meta(max_length=MAX_LOGIT_BIAS)]
BadWords = Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=256)]],
                     msgspec.Meta(max_length=MAX_BAD_WORDS)]
# vLLM's --speculative-config name, per request: every surface's request carries it to the daemon
# through `model_sampling`.
SpeculativeTokens = Annotated[Annotated[int, msgspec.Meta(ge=0)] | None, honoured(
    "caps the drafts speculative decoding makes for this request a step (0: none; above the "
    "server's --speculative-config, the server's)")]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (with include_usage)


class _Sampling(GuidedFields, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by completions and chat (and the guides: proxy/guides.py); None means
    "the default". The marks: see proxy/fields.py."""

    model: str | None = None
    n: N = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    # vLLM's extension: each choice also carries its token ids, so a client can count tokens.
    return_token_ids: bool = False
    user: Annotated[str | None, no_op(END_USER,
                                      "user-1")] = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    # vLLM's extensions.
    repetition_penalty: RepetitionPenalty | None = None
    min_p: MinP | None = None
    bad_words: BadWords | None = None
    stop_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_STOP)] | None = None
    num_speculative_tokens: SpeculativeTokens = None
    priority: Annotated[Any, refused(NO_PRIORITY, 1, (0,))] = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and
                                           self.stream_options.continuous_usage_stats)


class CompletionRequest(_Sampling, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of such lists (`prompt_forms`).
    prompt: str | Annotated[list[str | TokenId | TokenIds], msgspec.Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    echo: bool = False
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: Annotated[Any, refused("no model served here fills in a middle", "}", ("",))] = None
    best_of: Annotated[Any, refused("only 1 candidate per choice is generated", 2, (1,))] = None

    @property
    def prompts(self) -> list[str]:
        """The prompts given as text (none when they are token ids)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        return [p for p in self.prompt if isinstance(p, str)]

    @property
    def prompt_ids(self) -> list[list[int]]:
        """The prompts given as token ids (none when they are text)."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], str):
            return []
        if isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return self.prompt  # type: ignore[return-value]

    @property
    def num_prompts(self) -> int:
        return len(self.prompts) or len(self.prompt_ids)


class TextPart(msgspec.Struct):
    type: Literal["text"]
    text: str


class CalledFunction(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ChatToolCall(msgspec.Struct):
    id: str
    function: CalledFunction
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Null or left out only where an assistant message calls tools (check_chat).
    content: str | list[TextPart] | msgspec.UnsetType | None = msgspec.UNSET
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool message's: the call it answers

    def __post_init__(self) -> None:
        # What the role needs (msgspec reports these at the message's path, like its own).
        if self.role != "assistant" or not self.tool_calls:
            if self.content is msgspec.UNSET:
                raise ValueError("Object missing required field `content`")
            if self.content is None:
                raise ValueError(f"a {self.role} message's content must not be null")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("Object missing required field `tool_call_id`")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message may have tool_calls")

    def to_record(self) -> Message:
        content = self.content
        if isinstance(content, list):
            text: str | None = "\n".join(part.text for part in content)
        else:
            text = None if content is msgspec.UNSET else content
        calls = [ToolCall(c.id, c.function.name, c.function.arguments)
                 for c in self.tool_calls or ()]
        return Message("system" if self.role == "developer" else self.role, text, calls,
                       self.tool_call_id)


class ChatRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[ChatTool] | None, honoured(TOOLS_NOTE)] = None
    tool_choice: ChatToolChoice | None = None
    parallel_tool_calls: Annotated[bool | None, honoured(PARALLEL_NOTE)] = None
    metadata: Annotated[dict[str, str] | None, no_op(
        "kept by OpenAI only for stored completions, which are not offered",
        {"k": "v"})] = None
    store: Annotated[Any, refused("stored chat completions are not offered", True,
                                  (False,))] = None
    prompt_cache_key: Annotated[str | None, no_op(CACHE_HINT, "k")] = None
    prompt_cache_retention: Annotated[str | None, no_op(CACHE_HINT, "24h")] = None
    prompt_cache_options: Annotated[dict[str, Any] | None, no_op(CACHE_HINT, {})] = None
    safety_identifier: Annotated[str | None, no_op(
        END_USER, "u-1")] = None
    service_tier: Annotated[str | None, no_op(LATENCY_HINT, "auto")] = None
    prediction: Annotated[dict[str, Any] | None, no_op(
        "predicted outputs only make an answer faster", {"type": "content", "content": "x"})] \
        = None
    modalities: Annotated[Any, refused("only text is generated", ["text", "audio"],
                                       (["text"],))] = None
    audio: Annotated[Any, refused("only text is generated", {"voice": "alloy"})] = None
    functions: Annotated[Any, refused("the deprecated functions API is not served",
                                      [{"name": "f"}])] = None
    function_call: Annotated[Any, refused("the deprecated functions API is not served",
                                          "auto")] = None
    reasoning_effort: Annotated[Any, refused("no model served here reasons", "high",
                                             ("none",))] = None
    verbosity: Annotated[Any, refused("the answer's length is not steered", "low")] = None
    web_search_options: Annotated[Any, refused("no search is run", {})] = None
    moderation: Annotated[Any, refused("no moderation is run", {})] = None


def _refuse(param: str, why: str) -> ApiError:
    return ApiError(400, f"'{param}' {why}", param=param, code="unsupported_parameter")


def _check_unsupported(req: _Sampling) -> None:
    options = req.stream_options
    if options is not None and not req.stream:
        raise _refuse("stream_options", "is only allowed when 'stream' is true")
    if options is not None and options.continuous_usage_stats and not options.include_usage:
        raise ApiError(400, "'stream_options.continuous_usage_stats' requires "
                       "'stream_options.include_usage': true",
                       param="stream_options.continuous_usage_stats", code="invalid_value")


def check_completion(req: CompletionRequest) -> None:
    _check_unsupported(req)
    check_prompt(req.prompt)


def check_prompt(prompt: str | list[str | int | list[int]]) -> None:
    """One of the four forms, and at most MAX_PROMPTS prompts."""
    if isinstance(prompt, str):
        return
    kinds = {type(p) for p in prompt}
    if len(kinds) > 1:
        raise ApiError(400, "'prompt' must be a string, a list of strings, a list of token ids "
                       "or a list of lists of token ids, not a mix", param="prompt",
                       code="invalid_value")
    if kinds != {int} and len(prompt) > MAX_PROMPTS:
        raise ApiError(400, f"'prompt' holds {len(prompt)} prompts, more than {MAX_PROMPTS}",
                       param="prompt", code="invalid_value")


def check_sequences(num_prompts: int, n: int, limit: int) -> None:
    """At most `limit` sequences (prompts x n) in one request: 400 naming `n`, or `prompt`
    when n is 1 and the prompts alone are too many."""
    count = num_prompts * n
    if count > limit:
        made_of = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
        raise ApiError(400, f"the request asks for {count} sequences ({made_of}), more than the "
                       f"server's limit of {limit} per request", param="n" if n > 1 else "prompt",
                       code="too_many_sequences")


def check_chat(req: ChatRequest) -> None:
    _check_unsupported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "'top_logprobs' requires 'logprobs': true", param="top_logprobs",
                       code="invalid_value")


def check_max_tokens(max_tokens: int | None, min_tokens: int, param: str,
                     max_model_len: int | None) -> None:
    """What the proxy can check of a max-tokens field (`param`); an omitted one means the rest
    of the context, which the daemon resolves per prompt (and checks min_tokens against)."""
    if max_tokens is None:
        return
    if max_model_len is not None and max_tokens > max_model_len:
        raise ApiError(400, f"'{param}' is {max_tokens}, more than the model's context length "
                       f"{max_model_len}", param=param, code="context_length_exceeded")
    if min_tokens > max_tokens:
        raise ApiError(400, f"'min_tokens' ({min_tokens}) must be <= '{param}' "
                       f"({max_tokens})", param="min_tokens", code="invalid_value")


def sampling_params(req: _Sampling, max_tokens: int | None, param: str,
                    max_model_len: int | None,
                    defaults: GenerationDefaults | None = None) -> SamplingParams:
    """The record for the daemon; `param` names the max-tokens field the client used; a
    sampling field the request omits takes the model's default (`defaults`), else the API's."""
    check_max_tokens(max_tokens, req.min_tokens, param, max_model_len)
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if isinstance(req, CompletionRequest):
        logprobs = req.logprobs
    else:
        logprobs = (req.top_logprobs or 0) if isinstance(req, ChatRequest) and req.logprobs else None
    return SamplingParams(
        max_tokens=max_tokens,
        **model_sampling(req, defaults),
        seed=req.seed,
        stop=[s for s in stop if s],
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        stop_token_ids=req.stop_token_ids or [],
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=req.logit_bias or {},
        bad_words=req.bad_words or [],
        echo=isinstance(req, CompletionRequest) and req.echo,
        guide=request_guide(req),
    )


class SamplingFields(Protocol):
    """The sampling fields every endpoint's request has (a model may default them), and the
    engine's (num_speculative_tokens)."""

    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None
    num_speculative_tokens: int | None


def model_sampling(req: SamplingFields, defaults: GenerationDefaults | None) -> dict[str, Any]:
    """temperature, top_p, top_k, min_p and repetition_penalty: the request's, else the model's
    (vLLM's --generation-config auto), else the API's; num_speculative_tokens as it is."""
    d = defaults or GenerationDefaults()

    def pick(given: Any, model: Any, api: Any) -> Any:
        return given if given is not None else model if model is not None else api

    top_k = pick(req.top_k, d.top_k, -1)
    return {"temperature": pick(req.temperature, d.temperature, 1.0),
            "top_p": pick(req.top_p, d.top_p, 1.0), "top_k": -1 if top_k == 0 else top_k,
            "min_p": pick(req.min_p, d.min_p, 0.0),
            "repetition_penalty": pick(req.repetition_penalty, d.repetition_penalty, 1.0),
            "num_speculative_tokens": req.num_speculative_tokens}
