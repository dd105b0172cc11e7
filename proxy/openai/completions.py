"""POST /v1/completions and POST /v1/chat/completions.

Both routes share one flow: validate -> Submit -> wait for the daemon's first record while
watching the client (so a rejection still gets its HTTP status and a queued request whose
client leaves is aborted) -> then either collect everything (still watching) or stream SSE.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ipc.records import RequestKind, SamplingParams, Submit
from proxy.bodies import check_model, client_request_id, decode_body, new_id
from proxy.engine.client import EngineClient
from proxy.engine.collected import CollectedBudget, check_collected
from proxy.engine.exchange import exchange
from proxy.engine.metrics import RequestTimer
from proxy.openai.completion_answer import CHAT, COMPLETION, CompletionAnswer, Shape, Wants
from proxy.openai.schemas import (
    ChatRequest,
    CompletionRequest,
    check_chat,
    check_completion,
    check_sequences,
    sampling_params,
)
from proxy.openai.tool_requests import chat_tool_use, tool_guide
from proxy.options import ProxyOptions


async def respond(request: Request, submit: Submit, shape: Shape, wants: Wants) -> Response:
    options: ProxyOptions = request.app.state.options
    budget = None if wants.stream else CollectedBudget(
        options.max_collected_bytes, submit.sampling.logprobs, wants.max_tokens_param)
    answer = CompletionAnswer(submit, shape, served_model(request), wants, budget)
    timer = RequestTimer(request.app.state.metrics, shape.endpoint, submit.t_submit)
    return await exchange(request, submit, answer, wants.stream, timer)


def served_model(request: Request) -> str:
    engine: EngineClient = request.app.state.engine
    return engine.model or request.app.state.options.model


def served_models(request: Request) -> tuple[str, ...]:
    engine: EngineClient = request.app.state.engine
    names = [request.app.state.options.model]
    if engine.model is not None and engine.model not in names:
        names.insert(0, engine.model)
    return tuple(names)


class Begun(NamedTuple):
    rid: str  # the engine's key
    client_id: str | None  # the client's X-Request-Id
    t_start: float  # arrival


def _begin(request: Request, shape: Shape) -> Begun:
    t_start = time.monotonic()
    client_id = client_request_id(request.headers.get("x-request-id"))
    rid = request.state.request_id = new_id(shape.prefix)
    return Begun(rid, client_id, t_start)


async def completions(request: Request) -> Response:
    begun = _begin(request, COMPLETION)
    submit, wants = _completion(request, begun, await request.body())
    return await respond(request, submit, COMPLETION, wants)


async def chat_completions(request: Request) -> Response:
    begun = _begin(request, CHAT)
    submit, wants = _chat(request, begun, await request.body())
    return await respond(request, submit, CHAT, wants)


def _completion(request: Request, begun: Begun, body: bytes) -> tuple[Submit, Wants]:
    req = decode_body(body, CompletionRequest)
    check_completion(req)
    check_model(req.model, served_models(request))
    engine: EngineClient = request.app.state.engine
    sampling = sampling_params(req, req.max_tokens, "max_tokens", engine.max_model_len,
                               engine.generation_defaults)
    _check_size(request, req, req.num_prompts, sampling, "max_tokens")
    submit = Submit(rid=begun.rid, kind=RequestKind.COMPLETION, sampling=sampling,
                    n=req.n, prompts=req.prompts, prompt_ids=req.prompt_ids,
                    t_submit=begun.t_start, client_id=begun.client_id)
    return submit, Wants(req.stream, req.include_usage, req.return_token_ids,
                         req.continuous_usage)


def _chat(request: Request, begun: Begun, body: bytes) -> tuple[Submit, Wants]:
    req = decode_body(body, ChatRequest)
    check_chat(req)
    check_model(req.model, served_models(request))
    engine: EngineClient = request.app.state.engine
    max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, param = req.max_tokens, "max_tokens"
    sampling = sampling_params(req, max_tokens, param, engine.max_model_len,
                               engine.generation_defaults)
    use = chat_tool_use(req.tools, req.tool_choice, req.parallel_tool_calls,
                        engine.single_tool_call)
    fmt = engine.tool_call_format
    if use is not None:
        sampling = msgspec.structs.replace(sampling, guide=tool_guide(use, fmt, sampling.guide))
    _check_size(request, req, 1, sampling, param)
    submit = Submit(rid=begun.rid, kind=RequestKind.CHAT, sampling=sampling,
                    n=req.n, messages=[m.to_record() for m in req.messages],
                    t_submit=begun.t_start, client_id=begun.client_id,
                    tools=list(use.tools) if use is not None else [])
    return submit, Wants(req.stream, req.include_usage, req.return_token_ids,
                         req.continuous_usage, param, use, fmt)


def _check_size(request: Request, req: CompletionRequest | ChatRequest, num_prompts: int,
                sampling: SamplingParams, param: str) -> None:
    """The request's sequences within the cap; and unless it streams, what it could collect
    within the proxy's budget for one answer."""
    options: ProxyOptions = request.app.state.options
    check_sequences(num_prompts, req.n, options.max_seqs_per_request)
    if not req.stream and sampling.max_tokens is not None:
        check_collected(num_prompts * req.n, sampling.max_tokens, sampling.logprobs,
                        options.max_collected_bytes, param)


routes = [
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
