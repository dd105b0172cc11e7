"""POST /v1/completions and POST /v1/chat/completions.

Both routes share one flow: validate -> Submit -> wait for the daemon's first record while
watching the client (so a rejection still gets its HTTP status and a queued request whose
client leaves is aborted) -> then either collect everything (still watching) or stream SSE.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ipc.records import Delta, Finish, FinishReason, RequestKind, Submit, TokenLogprob, Usage
from proxy.cancellation import DisconnectWatch
from proxy.engine_client import EngineClient
from proxy.errors import ApiError
from proxy.metrics import RequestTimer
from proxy.schemas import (
    ChatRequest,
    CompletionRequest,
    check_chat,
    check_completion,
    check_model,
    client_request_id,
    decode_body,
    new_id,
    sampling_params,
)
from proxy.sse import DONE, SSEResponse, sse_event, sse_json

EngineStream = AsyncGenerator[Delta | Finish, None]


class Shape:
    """How one endpoint renders choices; the flow around it is shared."""

    kind = RequestKind.COMPLETION
    prefix = "cmpl-"
    full_object = "text_completion"
    chunk_object = "text_completion"
    endpoint = "completions"

    def choice(self, index: int, text: str, finish: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}

    def chunk_choice(self, index: int, text: str, finish: str | None,
                     first: bool) -> dict[str, Any]:
        return self.choice(index, text, finish)

    def logprobs(self, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
        """The legacy completions shape; `offset` is where the first token starts in the text."""
        # A token that starts inside a character (its first bytes came with the token before)
        # is placed at that character.
        seen = b""
        offsets = []
        for lp in lps:
            offsets.append(offset + len(seen.decode(errors="ignore")))
            seen += lp.token
        return {"tokens": [token_string(lp.token) for lp in lps],
                "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{token_string(t): v for t, v in lp.top} for lp in lps],
                "text_offset": offsets}


class ChatShape(Shape):
    kind = RequestKind.CHAT
    prefix = "chatcmpl-"
    full_object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    endpoint = "chat"

    def choice(self, index: int, text: str, finish: str | None) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": finish}

    def chunk_choice(self, index: int, text: str, finish: str | None,
                     first: bool) -> dict[str, Any]:
        delta: dict[str, str] = {"role": "assistant"} if first else {}
        if text or (first and finish is None):
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}

    def logprobs(self, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
        return {"content": [{**_token(lp.token, lp.logprob),
                             "top_logprobs": [_token(t, v) for t, v in lp.top]} for lp in lps],
                "refusal": None}


def token_string(raw: bytes) -> str:
    """A token's text as OpenAI shows it: bytes that are not (yet) a whole UTF-8 character
    appear as "\\xe6" escapes; `bytes` carries them exactly."""
    return raw.decode(errors="backslashreplace")


def _token(raw: bytes, logprob: float) -> dict[str, Any]:
    return {"token": token_string(raw), "logprob": logprob, "bytes": list(raw)}


COMPLETION = Shape()
CHAT = ChatShape()


def finish_reason(record: Finish) -> str:
    """The OpenAI finish_reason; a sequence the server itself gave up on is an error."""
    if record.reason is FinishReason.STOP or record.reason is FinishReason.LENGTH:
        return record.reason.value
    if record.reason is FinishReason.ABORT:
        cause = record.cause.value if record.cause else "unknown"
        raise ApiError(503, f"the request was aborted by the server ({cause})",
                       code="request_aborted")
    raise ApiError(500, record.message or "the engine failed on this request",
                   code="engine_error")


def usage_body(usages: dict[int, Usage], n: int) -> dict[str, Any]:
    # Every sample of a prompt reports that prompt's tokens: count them once per prompt.
    firsts = [u for i, u in usages.items() if i % n == 0]
    prompt = sum(u.prompt_tokens for u in firsts)
    completion = sum(u.completion_tokens for u in usages.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in firsts)}}


class Exchange:
    """One request's rendering state and figures."""

    def __init__(self, request: Request, submit: Submit, shape: Shape, model: str,
                 include_usage: bool, return_token_ids: bool) -> None:
        self.submit = submit
        self.return_token_ids = return_token_ids
        self.shape = shape
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())
        self.timer = RequestTimer(request.app.state.metrics, shape.endpoint, submit.t_submit)
        self.usages: dict[int, Usage] = {}
        self.wants_logprobs = submit.sampling.logprobs is not None

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.submit.rid, "object": obj, "created": self.created,
                "model": self.model}

    def on_record(self, record: Delta | Finish) -> str | None:
        """Accounts one record; returns the finish reason for a Finish."""
        self.timer.see(record)
        if isinstance(record, Delta):
            return None
        self.usages[record.index] = record.usage
        return finish_reason(record)

    def usage(self) -> dict[str, Any]:
        return usage_body(self.usages, self.submit.n)

    def done(self) -> None:
        self.timer.done()


async def collect(ex: Exchange, first: Delta | Finish | None, records: EngineStream) -> Response:
    texts: dict[int, list[str]] = {}
    token_ids: dict[int, list[int]] = {}
    logprobs: dict[int, list[TokenLogprob]] = {}
    finishes: dict[int, str] = {}
    record = first
    while record is not None:
        reason = ex.on_record(record)
        if isinstance(record, Delta):
            texts.setdefault(record.index, []).append(record.text)
            token_ids.setdefault(record.index, []).extend(record.token_ids)
            logprobs.setdefault(record.index, []).extend(record.logprobs or ())
        elif reason is not None:
            finishes[record.index] = reason
        record = await anext(records, None)
    choices = [ex.shape.choice(i, "".join(texts.get(i, ())), finishes.get(i))
               for i in sorted(finishes)]
    for choice in choices:
        if ex.return_token_ids:
            choice["token_ids"] = token_ids.get(choice["index"], [])
        if ex.wants_logprobs:
            choice["logprobs"] = ex.shape.logprobs(logprobs.get(choice["index"], []), 0)
    body = {**ex.head(ex.shape.full_object), "choices": choices, "usage": ex.usage()}
    ex.done()
    return JSONResponse(body)


async def stream(ex: Exchange, first: Delta | Finish | None,
                 records: EngineStream) -> AsyncIterator[bytes]:
    started: set[int] = set()
    head = ex.head(ex.shape.chunk_object)
    # Every chunk is {**head, "choices": [choice], **usage}: its constant bytes are encoded
    # once, and only the choice per event (byte for byte what dumping the whole dict gives).
    before = b"data: " + sse_json(head)[:-1] + b',"choices":['
    after = b'],"usage":null}\n\n' if ex.include_usage else b"]}\n\n"
    shape, token_ids = ex.shape, ex.return_token_ids
    offsets: dict[int, int] = {}  # per choice, where its next delta starts in its text
    try:
        record = first
        while record is not None:
            reason = ex.on_record(record)
            delta = record if isinstance(record, Delta) else None
            index = record.index
            is_first = index not in started
            if is_first:
                started.add(index)
            choice = shape.chunk_choice(index, "" if delta is None else delta.text, reason,
                                        is_first)
            if token_ids and delta is not None:
                choice["token_ids"] = delta.token_ids
            if delta is not None and delta.logprobs is not None:
                offset = offsets.get(index, 0)
                choice["logprobs"] = shape.logprobs(delta.logprobs, offset)
                offsets[index] = offset + len(delta.text)
            yield before + sse_json(choice) + after
            record = await anext(records, None)
        if ex.include_usage:
            yield sse_event({**head, "choices": [], "usage": ex.usage()})
        yield DONE
        ex.done()
    except ApiError as exc:
        # Headers are gone already: the error travels as the last event.
        yield sse_event(exc.body())
    finally:
        await records.aclose()


async def respond(request: Request, submit: Submit, shape: Shape,
                  req: CompletionRequest | ChatRequest) -> Response:
    engine: EngineClient = request.app.state.engine
    records = engine.generate(submit)
    # One watcher for the whole request: while queued, while collecting, while streaming.
    watch = DisconnectWatch(request.receive)
    streaming = False
    try:
        with watch:
            first = await anext(records, None)
        ex = Exchange(request, submit, shape, served_model(request), req.include_usage,
                      req.return_token_ids)
        if req.stream:
            streaming = True  # from here the response closes the watch and the records
            return SSEResponse(stream(ex, first, records), watch=watch, source=records)
        with watch:
            return await collect(ex, first, records)
    finally:
        if not streaming:
            watch.close()
            await records.aclose()


def served_model(request: Request) -> str:
    engine: EngineClient = request.app.state.engine
    return engine.model or request.app.state.settings.model


def served_models(request: Request) -> tuple[str, ...]:
    engine: EngineClient = request.app.state.engine
    names = [request.app.state.settings.model]
    if engine.model is not None and engine.model not in names:
        names.insert(0, engine.model)
    return tuple(names)


def _begin(request: Request, shape: Shape) -> tuple[str, str | None, float]:
    """(engine key, the client's X-Request-Id, arrival time)."""
    t_start = time.monotonic()
    client_id = client_request_id(request.headers.get("x-request-id"))
    rid = request.state.request_id = new_id(shape.prefix)
    return rid, client_id, t_start


async def completions(request: Request) -> Response:
    rid, client_id, t_start = _begin(request, COMPLETION)
    req = decode_body(await request.body(), CompletionRequest)
    check_completion(req)
    check_model(req.model, served_models(request))
    engine: EngineClient = request.app.state.engine
    sampling = sampling_params(req, req.max_tokens, "max_tokens", engine.max_model_len)
    submit = Submit(rid=rid, epoch=engine.epoch, kind=RequestKind.COMPLETION, sampling=sampling,
                    n=req.n, prompts=req.prompts, t_submit=t_start, client_id=client_id)
    return await respond(request, submit, COMPLETION, req)


async def chat_completions(request: Request) -> Response:
    rid, client_id, t_start = _begin(request, CHAT)
    req = decode_body(await request.body(), ChatRequest)
    check_chat(req)
    check_model(req.model, served_models(request))
    engine: EngineClient = request.app.state.engine
    max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, param = req.max_tokens, "max_tokens"
    sampling = sampling_params(req, max_tokens, param, engine.max_model_len)
    submit = Submit(rid=rid, epoch=engine.epoch, kind=RequestKind.CHAT, sampling=sampling,
                    n=req.n, messages=[m.to_record() for m in req.messages], t_submit=t_start,
                    client_id=client_id)
    return await respond(request, submit, CHAT, req)


routes = [
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
