"""POST /v1/messages and POST /v1/messages/count_tokens.

A message is a chat request at the edge (proxy/anthropic/translate.py) and is served by the chat
path's exchange (proxy/engine/exchange.py): the same queue, the same watch on the client, so a
dropped stream, a dropped non-streaming request and a dropped queued one are aborted at once,
as on /v1/chat/completions. count_tokens renders the prompt with the chat template and counts
it, as /tokenize does, without a forward pass.

``anthropic-version`` and ``anthropic-beta`` headers, and Claude Code's ``?beta=true``, are
accepted and change nothing: the shapes served are the Messages API's of 2023-06-01, and what a
beta would add is either served (tools with ``defer_loading``, context edits that clear
thinking, effort) or refused by its field.
"""

from __future__ import annotations

import time

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ipc.records import RequestKind, SamplingParams, Submit
from proxy.anthropic import answer as answer_module
from proxy.anthropic.answer import PING, MessageAnswer
from proxy.anthropic.request import CountTokensRequest, MessagesRequest
from proxy.anthropic.translate import chat_messages, check_prompt, sampling, tool_use
from proxy.bodies import check_model, client_request_id, decode_body, new_id
from proxy.engine.client import EngineClient
from proxy.engine.collected import CollectedBudget, check_collected
from proxy.engine.exchange import exchange
from proxy.engine.metrics import RequestTimer
from proxy.engine.token_stream import Keepalive
from proxy.openai.completions import served_models
from proxy.openai.tokenize import ask
from proxy.openai.tool_requests import tool_guide
from proxy.options import ProxyOptions


async def messages(request: Request) -> Response:
    t_start = time.monotonic()
    client_id = client_request_id(request.headers.get("x-request-id"))
    rid = request.state.request_id = new_id("msg_")
    req = decode_body(await request.body(), MessagesRequest)
    check_model(req.model, served_models(request))
    check_prompt(req)
    engine: EngineClient = request.app.state.engine
    options: ProxyOptions = request.app.state.options
    params = sampling(req, engine.max_model_len, engine.generation_defaults)
    use = tool_use(req, engine.single_tool_call)
    fmt = engine.tool_call_format
    if use is not None:
        params = msgspec.structs.replace(params, guide=tool_guide(use, fmt, params.guide))
    budget = None
    if not req.stream:
        assert params.max_tokens is not None
        check_collected(1, params.max_tokens, None, options.max_collected_bytes, "max_tokens")
        budget = CollectedBudget(options.max_collected_bytes, None, "max_tokens")
    submit = Submit(rid=rid, kind=RequestKind.CHAT, sampling=params,
                    messages=chat_messages(req), t_submit=t_start, client_id=client_id,
                    tools=list(use.tools) if use is not None else [])
    answer = MessageAnswer(rid, req.model, use, fmt, req.stream, budget)
    del req  # let the body go while the request is held
    timer = RequestTimer(request.app.state.metrics, "messages", t_start)
    return await exchange(request, submit, answer, answer.stream, timer,
                          Keepalive(PING, answer_module.PING_INTERVAL_S))


async def count_tokens(request: Request) -> Response:
    req = decode_body(await request.body(), CountTokensRequest)
    check_model(req.model, served_models(request))
    check_prompt(req)
    use = tool_use(req, False)
    rid = request.state.request_id = new_id("tok-")
    submit = Submit(rid=rid, kind=RequestKind.TOKENIZE, sampling=SamplingParams(),
                    messages=chat_messages(req), t_submit=time.monotonic(),
                    tools=list(use.tools) if use is not None else [],
                    client_id=client_request_id(request.headers.get("x-request-id")))
    return JSONResponse({"input_tokens": len((await ask(request, submit)).token_ids)})


routes = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
