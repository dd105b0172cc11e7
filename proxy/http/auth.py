"""API-key check as pure ASGI middleware.

Pure ASGI (not BaseHTTPMiddleware) because the handlers' disconnect detection needs the
server's own ``receive``: wrapping it in a task-and-queue layer delays or loses http.disconnect.

The key is read from ``Authorization: Bearer`` or, as Anthropic's clients send it, ``x-api-key``.
The key a request matched names its tenant (``scope["state"]["tenant"]``, read by
proxy/http/tenancy.py): a tag derived from the key, never the key, under which the store keeps what
the request stores.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.http.errors import ApiError, error_response

# The API lives under /v1, and vLLM's /tokenize and /detokenize beside it; /health, /metrics and
# /openapi.json stay open for probes and scrapers unless the key guards everything.
PROTECTED_PREFIX = ("/v1", "/tokenize", "/detokenize")


def tenant_tag(key: bytes) -> str:
    """The tenant a key names in the store: a slow hash, so that a store's reader learns
    nothing of a short key from it."""
    return hashlib.pbkdf2_hmac("sha256", key, b"tether tenant", 100_000)[:8].hex()


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: Sequence[str], everywhere: bool = False) -> None:
        self.app = app
        self.keys = [key.encode() for key in keys]
        self.prefix = ("/",) if everywhere else PROTECTED_PREFIX
        self.tenants = [tenant_tag(key) for key in self.keys]

    # A plain function returning the inner app's awaitable: no frame of ours stays alive for
    # the request's lifetime (thousands of requests can be held open at once).
    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        if scope["type"] != "http" or not self.keys:
            return self.app(scope, receive, send)
        tenant = self._tenant(scope)
        if tenant is not None:
            scope.setdefault("state", {})["tenant"] = tenant
        if tenant is not None or not scope["path"].startswith(self.prefix):
            return self.app(scope, receive, send)
        exc = ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' "
                       "(or 'x-api-key: <key>')",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return error_response(exc, scope["path"])(scope, receive, send)

    def _tenant(self, scope: Scope) -> str | None:
        """The tenant of the key the request offers; None when it offers none of ours."""
        offered = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    offered = token.strip()
                break
            if name == b"x-api-key":  # Anthropic's clients send the key so
                offered = value.strip()
                break
        # Compare against every key so the time taken does not tell which one nearly matched.
        matched: str | None = None
        for key, tenant in zip(self.keys, self.tenants, strict=True):
            if hmac.compare_digest(offered, key):
                matched = tenant
        return matched
