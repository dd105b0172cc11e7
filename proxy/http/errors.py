"""OpenAI-shaped errors: one exception type for everything a handler can refuse, one renderer.

Every refusal the client can cause is an `ApiError` with the right status; the app's exception
handlers turn it (and Starlette's own 404/405) into ``{"error": {message, type, param, code}}``.
The daemon refuses with typed reasons (ipc/reasons.py), which `REFUSALS` turns into statuses and
codes: the one place that says how an engine's refusal reads over HTTP.
An API whose clients read errors in a shape of their own (Anthropic's Messages API) says so for
its routes (`shape_errors`), and every refusal on them, the middleware's too, takes that shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ipc.reasons import Reason

log = logging.getLogger("tether.proxy")

# Not an HTTP status anyone receives: the client has gone. nginx's code for the same situation,
# so access logs tell a dropped request from a served one.
CLIENT_CLOSED_REQUEST = 499

_PHRASES = {
    400: "bad request",
    401: "unauthorized",
    404: "not found",
    405: "method not allowed",
    413: "request body too large",
    429: "too many requests",
    500: "internal server error",
    503: "service unavailable",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or default_type(status)
        self.headers = headers

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


# Each reason the daemon refuses for, as a client hears it: the HTTP status and OpenAI's code.
REFUSALS: dict[Reason, tuple[int, str | None]] = {
    Reason.INVALID: (400, None),
    Reason.CONTEXT_LENGTH_EXCEEDED: (400, "context_length_exceeded"),
    Reason.TOO_MANY_SEQUENCES: (400, "too_many_sequences"),
    Reason.MAX_TOKENS_TOO_SMALL: (400, "max_tokens_too_small"),
    Reason.INVALID_GRAMMAR: (400, "invalid_grammar"),
    Reason.GRAMMAR_TOO_COMPLEX: (400, "grammar_too_complex"),
    Reason.GRAMMAR_TIMEOUT: (400, "grammar_timeout"),
    Reason.CONVERSATION_FULL: (400, "conversation_full"),
    Reason.NOT_FOUND: (404, "not_found"),
    Reason.PREVIOUS_RESPONSE_NOT_FOUND: (404, "previous_response_not_found"),
    Reason.DUPLICATE_ID: (409, None),
    Reason.CONVERSATION_LOCKED: (409, "conversation_locked"),
    Reason.TOO_LARGE: (413, None),
    Reason.NO_STORE: (500, None),
    Reason.STORE_ERROR: (500, "store_error"),
    Reason.STORE_TIMEOUT: (503, "store_timeout"),
    Reason.INTERNAL: (500, "internal_error"),
    Reason.VERSION_MISMATCH: (500, "version_mismatch"),
    Reason.SHUTTING_DOWN: (503, None),
    Reason.NOT_APPLIED: (503, None),
}


def refused(reason: Reason, message: str, param: str | None = None) -> ApiError:
    """The daemon's refusal as its client hears it."""
    status, code = REFUSALS[reason]
    return ApiError(status, message, param=param, code=code)


class ClientDisconnected(Exception):
    """The client closed its connection before the answer was ready."""


def default_type(status: int) -> str:
    if status == 503:
        return "service_unavailable"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


# Routes whose errors take another API's shape: (path prefix, renderer).
_SHAPES: list[tuple[str, Callable[[ApiError], Response]]] = []


def shape_errors(prefix: str, render: Callable[[ApiError], Response]) -> None:
    """Refusals on the routes under `prefix` are rendered by `render`."""
    _SHAPES.append((prefix, render))


def error_response(exc: ApiError, path: str = "") -> Response:
    """The refusal as the route at `path` renders its errors (OpenAI's shape by default)."""
    for prefix, render in _SHAPES:
        if path.startswith(prefix):
            return render(exc)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc, request.url.path)


async def http_error_handler(request: Request, exc: Exception) -> Response:
    """Starlette's routing errors (unknown route, wrong method) in the OpenAI shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
        code: str | None = "not_found"
    elif exc.status_code == 405:
        message = f"method {request.method} not allowed on {request.url.path}"
        code = "method_not_allowed"
    else:
        message = exc.detail or _PHRASES.get(exc.status_code, "error")
        code = None
    return error_response(ApiError(exc.status_code, message, code=code,
                                   headers=dict(exc.headers or {})), request.url.path)


async def disconnected_handler(request: Request, exc: Exception) -> Response:
    # Nobody reads this response; answering keeps the disconnect out of the error log.
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def unexpected_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(ApiError(500, "internal server error", code="internal_error"),
                          request.url.path)


EXCEPTION_HANDLERS = {
    ApiError: api_error_handler,
    HTTPException: http_error_handler,
    ClientDisconnected: disconnected_handler,
    ClientDisconnect: disconnected_handler,  # Starlette's: the client left while sending its body
    Exception: unexpected_handler,
}
