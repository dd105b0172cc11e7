"""Request bodies of the completions and chat routes, validated by msgspec while decoding.

Limits live in the types (``Meta(ge=1)``) so msgspec's error names the field and the limit;
`decode_body` turns its "at `$.field`" path into the OpenAI ``param``.
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from ipc.records import MAX_LOGPROBS, Message, SamplingParams
from proxy.errors import ApiError
from proxy.guides import GuidedFields, request_guide

T = TypeVar("T")

MAX_N = 128
MAX_PROMPTS = 256
MAX_STOP = 16
MAX_SEED = 2**63 - 1
# The proxy cannot count prompt tokens, so an omitted max_tokens gets a fixed default rather
# than "the rest of the context" (which the daemon would reject for any non-empty prompt).
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 512}

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=-1)]
Seed = Annotated[int, msgspec.Meta(ge=-MAX_SEED, le=MAX_SEED)]
Stop = str | Annotated[list[str], msgspec.Meta(max_length=MAX_STOP)]
N = Annotated[int, msgspec.Meta(ge=1, le=MAX_N)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Sampling(GuidedFields, kw_only=True):
    """Fields shared by completions and chat (and the guides: proxy/guides.py); None means
    "the default"."""

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
    user: str | None = None
    # Accepted so that clients sending the neutral value work; anything else is refused
    # rather than silently ignored.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | Annotated[list[str], msgspec.Meta(min_length=1, max_length=MAX_PROMPTS)]
    max_tokens: PositiveInt | None = None
    echo: bool = False
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: int | None = None

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else self.prompt


class TextPart(msgspec.Struct):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def to_record(self) -> Message:
        text = self.content if isinstance(self.content, str) else "\n".join(
            part.text for part in self.content)
        return Message("system" if self.role == "developer" else self.role, text)


class ChatRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None


_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}
_AT = re.compile(r"^(?P<what>.*?)(?: - at (?:`key` in )?`\$(?P<path>[^`]*)`)?$", re.DOTALL)
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>.*)`$", re.DOTALL)


def decode_body(body: bytes, struct_type: type[T]) -> T:
    """Decodes a JSON body into `struct_type`; ApiError(400) naming the field on any problem."""
    decoder = _decoders.get(struct_type)
    if decoder is None:
        decoder = _decoders[struct_type] = msgspec.json.Decoder(struct_type)
    try:
        return decoder.decode(body)  # type: ignore[no-any-return]
    except msgspec.ValidationError as exc:
        raise validation_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}",
                       code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None


def validation_error(text: str) -> ApiError:
    match = _AT.match(text)
    what = match.group("what") if match else text
    path = (match.group("path") or "") if match else ""
    param = path.removeprefix(".")
    missing = _MISSING.match(what)
    if missing:
        param = f"{param}.{missing.group('field')}" if param else missing.group("field")
        return ApiError(400, f"missing required field '{param}'", param=param,
                        code="missing_required_parameter")
    unknown = _UNKNOWN.match(what)
    if unknown:  # only where a type forbids unknown fields, as OpenAI does everywhere
        name = unknown.group("field")
        name = name if len(name) <= 64 else name[:64] + "..."
        param = f"{param}.{name}" if param else name
        return ApiError(400, f"Unknown parameter: '{param}'.", param=param,
                        code="unknown_parameter")
    if not param:
        return ApiError(400, f"invalid request body: {what}", code="invalid_value")
    return ApiError(400, f"invalid value for '{param}': {what}", param=param,
                    code="invalid_value")


def _refuse(param: str, why: str) -> ApiError:
    return ApiError(400, f"'{param}' {why}", param=param, code="unsupported_parameter")


def _check_unsupported(req: _Sampling) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise _refuse(name, "is not supported (only 0)")
    if req.logit_bias:
        raise _refuse("logit_bias", "is not supported")
    if req.stream_options is not None and not req.stream:
        raise _refuse("stream_options", "is only allowed when 'stream' is true")


def check_completion(req: CompletionRequest) -> None:
    _check_unsupported(req)
    if req.echo:
        raise _refuse("echo", "is not supported")
    if req.suffix:
        raise _refuse("suffix", "is not supported")
    if req.best_of not in (None, 1):
        raise _refuse("best_of", "is not supported (only 1)")


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
    if req.tools:
        raise _refuse("tools", "is not supported")


def sampling_params(req: _Sampling, max_tokens: int | None, param: str,
                    max_model_len: int | None) -> SamplingParams:
    """The record for the daemon; `param` names the max-tokens field the client used."""
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS["completion" if isinstance(req, CompletionRequest)
                                        else "chat"]
        if max_model_len is not None:
            max_tokens = min(max_tokens, max_model_len)
    elif max_model_len is not None and max_tokens > max_model_len:
        raise ApiError(400, f"'{param}' is {max_tokens}, more than the model's context length "
                       f"{max_model_len}", param=param, code="context_length_exceeded")
    if req.min_tokens > max_tokens:
        raise ApiError(400, f"'min_tokens' ({req.min_tokens}) must be <= '{param}' "
                       f"({max_tokens})", param="min_tokens", code="invalid_value")
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if isinstance(req, CompletionRequest):
        logprobs = req.logprobs
    else:
        logprobs = (req.top_logprobs or 0) if isinstance(req, ChatRequest) and req.logprobs else None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k in (None, 0) else req.top_k,
        seed=req.seed,
        stop=[s for s in stop if s],
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        guide=request_guide(req),
    )


# What a client may send as X-Request-Id, and so the form of every id this server hands out.
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)


def check_response_id(rid: str) -> str:
    """A path's response id; one no request could have been given is refused before it is sent
    to the daemon (an id of kilobytes would not even fit in a control record)."""
    if not _REQUEST_ID.match(rid):
        shown = rid if len(rid) <= 64 else rid[:64] + "..."
        raise ApiError(400, f"invalid response id {shown!r}: ids are 1 to 128 characters of "
                       "[A-Za-z0-9._:-]", param="response_id", code="invalid_value")
    return rid


def new_id(prefix: str) -> str:
    """A request's engine key and object id: always the server's own, never a client's, so
    clients that pick the same X-Request-Id can never refuse or abort each other's work."""
    return prefix + uuid.uuid4().hex


def client_request_id(header: str | None) -> str | None:
    """The client's X-Request-Id (echoed and logged, never a key); 400 when malformed."""
    if header is not None and not _REQUEST_ID.match(header):
        raise ApiError(400, "X-Request-Id must be 1 to 128 characters of [A-Za-z0-9._:-]",
                       param="X-Request-Id", code="invalid_request_id")
    return header


def check_model(model: str | None, served: tuple[str, ...]) -> None:
    """An omitted model means the served one; any other name is a 404 as OpenAI answers."""
    if model is not None and model not in served:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                       f"'{served[0]}'", param="model", code="model_not_found")
