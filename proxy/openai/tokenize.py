"""POST /tokenize and POST /detokenize, in vLLM's shapes.

Only the daemon has the tokenizer: each request is a Submit of kind TOKENIZE or DETOKENIZE,
answered by the daemon at once with one Delta (the ids, or the text) and no forward pass. A
prompt gets the tokenizer's special tokens unless ``add_special_tokens`` is false; chat
``messages`` are rendered by the chat template (``add_generation_prompt``, true by default) and
get none unless it is true, as in vLLM. Fields these requests do not have are a 400 naming them.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ipc.records import Delta, RequestKind, SamplingParams, Submit
from proxy.bodies import check_model, client_request_id, decode_body, new_id
from proxy.engine.client import EngineClient
from proxy.http.errors import ApiError
from proxy.openai.completions import served_models
from proxy.openai.schemas import ChatMessage, TokenId


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's TokenizeCompletionRequest (``prompt``) or TokenizeChatRequest (``messages``)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    add_generation_prompt: bool | None = None  # messages only; None: true


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int | None
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct):
    prompt: str


async def tokenize(request: Request) -> Response:
    req = decode_body(await request.body(), TokenizeRequest)
    check_model(req.model, served_models(request))
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "send either 'prompt' or 'messages'",
                       param="prompt" if req.prompt is None else "messages",
                       code="invalid_value")
    if req.prompt is not None and req.add_generation_prompt is not None:
        raise ApiError(400, "'add_generation_prompt' applies to 'messages' only",
                       param="add_generation_prompt", code="invalid_value")
    submit = _submit(request, RequestKind.TOKENIZE,
                     prompts=[] if req.prompt is None else [req.prompt],
                     messages=[m.to_record() for m in req.messages or ()],
                     add_special_tokens=req.add_special_tokens,
                     add_generation_prompt=req.add_generation_prompt is not False)
    ids = (await ask(request, submit)).token_ids
    engine: EngineClient = request.app.state.engine
    return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids})


async def detokenize(request: Request) -> Response:
    req = decode_body(await request.body(), DetokenizeRequest)
    check_model(req.model, served_models(request))
    submit = _submit(request, RequestKind.DETOKENIZE, prompt_ids=[req.tokens])
    return JSONResponse({"prompt": (await ask(request, submit)).text})


def _submit(request: Request, kind: RequestKind, **fields: Any) -> Submit:
    rid = request.state.request_id = new_id("tok-")
    return Submit(rid=rid, kind=kind, sampling=SamplingParams(), t_submit=time.monotonic(),
                  client_id=client_request_id(request.headers.get("x-request-id")), **fields)


async def ask(request: Request, submit: Submit) -> Delta:
    """The daemon's answer: its one Delta (a refusal is raised as the ApiError it names)."""
    engine: EngineClient = request.app.state.engine
    answer: Delta | None = None
    async for batch in engine.generate(submit):
        for record in batch:
            if isinstance(record, Delta):
                answer = record
    assert answer is not None, "the daemon answers a tokenize request with a Delta"
    return answer


routes = [
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
