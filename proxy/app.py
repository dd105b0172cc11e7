"""The proxy's ASGI application: routes, middleware and the engine client's lifetime."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable

import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.access_log import AccessLogMiddleware
from proxy.anthropic import routes as anthropic
from proxy.bodies import REQUEST_ID_PATTERN, check_model
from proxy.engine.client import EngineClient
from proxy.engine.metrics import CONTENT_TYPE, ProxyMetrics
from proxy.http.auth import ApiKeyMiddleware
from proxy.http.errors import EXCEPTION_HANDLERS, ApiError, error_response
from proxy.openai import completions, tokenize
from proxy.openapi import openapi_json
from proxy.options import ProxyOptions
from proxy.responses import conversations
from proxy.responses import routes as responses

_REQUEST_ID = re.compile(REQUEST_ID_PATTERN.encode())


class RequestIdMiddleware:
    """Echoes the request id on every answer: the client's valid X-Request-Id, else the id the
    handler made (``request.state.request_id``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    # A plain function returning the inner app's awaitable: no frame of ours stays alive for
    # the request's lifetime (thousands of requests can be held open at once).
    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        if scope["type"] != "http":
            return self.app(scope, receive, send)
        offered = dict(scope["headers"]).get(b"x-request-id")
        if offered is not None and not _REQUEST_ID.match(offered):
            offered = None

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                chosen = scope.get("state", {}).get("request_id")
                rid = offered if offered is not None else chosen.encode() if chosen else None
                if rid is not None:
                    message["headers"] = [*message.get("headers", []), (b"x-request-id", rid)]
            await send(message)

        return self.app(scope, receive, send_with_id)


class BodyLimitMiddleware:
    """413 for bodies over the limit: by Content-Length up front, by counting otherwise (a
    chunked body)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        if scope["type"] != "http":
            return self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            exc = self._too_large() if length.isdigit() else ApiError(
                400, "invalid Content-Length header", code="invalid_header")
            return error_response(exc, scope["path"])(scope, receive, send)
        if length is not None:
            return self.app(scope, receive, send)  # the server reads no more than it says
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._too_large()
            return message

        return self.app(scope, counting_receive, send)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"request body larger than {self.max_bytes} bytes",
                        code="request_too_large")


# --- small routes -----------------------------------------------------------------------------


async def health(request: Request) -> Response:
    engine: EngineClient = request.app.state.engine
    version = request.app.state.options.version
    if engine.up:
        return JSONResponse({"status": "ok", "version": version, "model": engine.model,
                             "max_model_len": engine.max_model_len,
                             "tensor_parallel_size": engine.tensor_parallel_size,
                             "generation_defaults": msgspec.to_builtins(
                                 engine.generation_defaults)})
    return JSONResponse({"status": "unavailable", "version": version,
                         "reason": engine.down_reason}, status_code=503)


def _model_card(request: Request, name: str) -> dict[str, object]:
    engine: EngineClient = request.app.state.engine
    return {"id": name, "object": "model", "created": request.app.state.started_at,
            "owned_by": "tether", "max_model_len": engine.max_model_len}


async def models(request: Request) -> Response:
    card = _model_card(request, completions.served_model(request))
    return JSONResponse({"object": "list", "data": [card]})


async def model(request: Request) -> Response:
    """One model, as OpenAI's `GET /v1/models/{model}` answers; an unknown id is a 404."""
    name: str = request.path_params["model"]
    check_model(name, completions.served_models(request))
    return JSONResponse(_model_card(request, name))


async def metrics(request: Request) -> Response:
    figures: ProxyMetrics = request.app.state.metrics
    return Response(figures.render(), media_type=CONTENT_TYPE)


# --- assembly ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    options: ProxyOptions = app.state.options
    engine = EngineClient(options.runtime_dir, options.max_waiting,
                          request_timeout=options.request_timeout_s,
                          stall_timeout=options.stall_timeout_s,
                          max_buffered=options.max_buffered_tokens,
                          merge_tokens=options.stream_merge_tokens)
    app.state.engine = engine
    app.state.metrics = ProxyMetrics(engine)
    app.state.started_at = int(time.time())
    await engine.start()
    try:
        yield
    finally:
        await responses.close_background(app)
        await engine.close()


def create_app(options: ProxyOptions) -> Starlette:
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        # :path: an id such as org/name arrives with its slash (clients send it as %2F).
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        *completions.routes,
        *responses.routes,
        *conversations.routes,
        *tokenize.routes,
        *anthropic.routes,
    ]
    middleware = [
        # Outermost: the access log sees every answer, CORS headers go on refusals too, and a
        # browser's preflight is answered before anything asks it for a key.
        Middleware(AccessLogMiddleware, sample=options.access_log_sample),
        *([Middleware(CORSMiddleware, allow_origins=cors.origins, allow_methods=cors.methods,
                      allow_headers=cors.headers, expose_headers=["X-Request-Id"])]
          if (cors := options.cors).origins else []),
        Middleware(RequestIdMiddleware),
        Middleware(ApiKeyMiddleware, keys=options.api_keys,
                   everywhere=options.api_key_everywhere),
        Middleware(BodyLimitMiddleware, max_bytes=options.max_body_bytes),
    ]
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
                    lifespan=lifespan)
    app.state.options = options
    return app
