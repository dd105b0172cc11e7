"""Errors in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, with its
statuses: an overloaded server is a 529 ``overloaded_error`` where the OpenAI routes answer 429
(too many requests waiting) or 503 (the engine unavailable), which Anthropic's clients retry.
Every refusal on /v1/messages takes this shape, the middleware's (a missing key, a body too
large) too (proxy/http/errors.py's `shape_errors`).
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse, Response

from proxy.http.errors import ApiError, shape_errors
from proxy.http.sse import sse_event

PREFIX = "/v1/messages"
OVERLOADED = 529

# Anthropic's error type of each status it answers; another 4xx is an invalid request.
_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          413: "request_too_large", OVERLOADED: "overloaded_error", 500: "api_error",
          504: "timeout_error"}


def status(exc: ApiError) -> int:
    return OVERLOADED if exc.status in (429, 503) else exc.status


def body(exc: ApiError) -> dict[str, Any]:
    code = status(exc)
    kind = _TYPES.get(code, "invalid_request_error" if code < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_event(exc: ApiError) -> bytes:
    """The event that ends a stream whose request failed."""
    return sse_event(body(exc), "error")


def response(exc: ApiError) -> Response:
    return JSONResponse(body(exc), status_code=status(exc), headers=exc.headers)


shape_errors(PREFIX, response)
