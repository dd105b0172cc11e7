"""One structured log line per HTTP request: method, route, status, duration, request ids, and
for a refused request the reason it was given (pure ASGI, so disconnects still reach the
handlers as they happen); and every request counted by route and status in /metrics
(`tether_http_requests_total`), whatever the log's sample.

A line is written when the answer's last byte is handed on, or when the client is seen to leave
first (``client_left``; ``status`` null if no answer had begun). Every 4xx and 5xx is written,
a 4xx at info (the client's doing) and a 5xx at warning; a successful request is written with
the probability --access-log-sample gives (1 = every one, 0 = no access log at all).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import orjson
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from proxy.engine.metrics import ProxyMetrics

log = logging.getLogger("tether.access")

# An error's JSON body is read this far for its message; a longer one is cut.
_REASON_BYTES = 2048


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp, sample: float, chance: Any = random.random) -> None:
        self.app = app
        self.sample = sample
        self.chance = chance

    # A plain function, and the line written when the answer's last byte is handed on or the
    # client is seen to leave, whichever comes first: no frame of ours stays alive for a
    # request's lifetime (thousands of streams can be held open).
    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        if scope["type"] != "http":
            return self.app(scope, receive, send)
        entry = _Entry(self, scope, receive, send)
        return self.app(scope, entry.receive, entry.send)


class _Entry:
    """One request's line in the making."""

    __slots__ = ("_receive", "_send", "log", "reason", "scope", "status", "t0", "written")

    def __init__(self, log: AccessLogMiddleware, scope: Scope, receive: Receive,
                 send: Send) -> None:
        self.log = log
        self.scope = scope
        self._receive = receive
        self._send = send
        self.written = False
        self.t0 = time.monotonic()
        self.status = 0
        self.reason: bytearray | None = None

    def send(self, message: Message) -> Awaitable[None]:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            if self.status >= 400:
                self.reason = bytearray()
        else:
            if self.reason is not None and len(self.reason) < _REASON_BYTES:
                self.reason += message.get("body", b"")[: _REASON_BYTES - len(self.reason)]
            if not message.get("more_body", False):
                self.write(left=False)
        return self._send(message)

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.write(left=True)
        return message

    def write(self, left: bool) -> None:
        if self.written:
            return
        self.written = True
        status = self.status
        scope = self.scope
        metrics: ProxyMetrics | None = getattr(scope["app"].state, "metrics", None)
        if metrics is not None:
            metrics.http_requests.labels(route_template(scope), str(status or "none")).inc()
        sample = self.log.sample
        if sample <= 0.0 or (status < 400 and self.log.chance() >= sample):
            return
        route = scope.get("route")
        fields: dict[str, Any] = {
            "method": scope["method"],
            "route": getattr(route, "path", None) or scope["path"][:256],
            "status": status or None,  # None: the client left before any answer
            "duration_s": round(time.monotonic() - self.t0, 6),
        }
        if left:
            fields["client_left"] = True
        state = scope.get("state") or {}
        if state.get("request_id"):
            fields["request_id"] = state["request_id"]
        offered = dict(scope["headers"]).get(b"x-request-id")
        if offered is not None:
            fields["client_request_id"] = offered[:128].decode("latin-1")
        if self.reason is not None:
            fields |= _reason(bytes(self.reason))
        level = logging.WARNING if status >= 500 else logging.INFO
        log.log(level, "%s %s %s", fields["method"], fields["route"], status or "-",
                extra={"fields": fields})


def route_template(scope: Scope) -> str:
    """The route's path template, never the path itself: a label's values must not be the
    client's to choose. A request refused before routing (401, 413) is matched here."""
    route = scope.get("route")
    if route is None:
        route = next((r for r in scope["app"].routes if r.matches(scope)[0] is not Match.NONE),
                     None)
    return getattr(route, "path", None) or "unmatched"


def _reason(body: bytes) -> dict[str, Any]:
    """An OpenAI-shaped error's message, param and code (what the client was told)."""
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return {}
    if not isinstance(error, dict):
        return {}
    return {key: error[key] for key in ("message", "param", "code") if error.get(key)}
