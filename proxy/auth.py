"""API-key check as pure ASGI middleware.

Pure ASGI (not BaseHTTPMiddleware) because the handlers' disconnect detection needs the
server's own ``receive``: wrapping it in a task-and-queue layer delays or loses http.disconnect.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.errors import ApiError, error_response

# The API lives under /v1, and vLLM's /tokenize and /detokenize beside it; /health, /metrics and
# /openapi.json stay open for probes and scrapers unless the key guards everything.
PROTECTED_PREFIX = ("/v1", "/tokenize", "/detokenize")


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: Sequence[str], everywhere: bool = False) -> None:
        self.app = app
        self.keys = [key.encode() for key in keys]
        self.prefix = ("/",) if everywhere else PROTECTED_PREFIX

    # A plain function returning the inner app's awaitable: no frame of ours stays alive for
    # the request's lifetime (thousands of requests can be held open at once).
    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        if (scope["type"] != "http" or not self.keys
                or not scope["path"].startswith(self.prefix) or self._allowed(scope)):
            return self.app(scope, receive, send)
        exc = ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return error_response(exc)(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        offered = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    offered = token.strip()
                break
        # Compare against every key so the time taken does not tell which one nearly matched.
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(offered, key)
        return matched
