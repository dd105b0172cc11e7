"""Each HTTP connection's share of the proxy, bounded before it has asked for anything.

uvicorn's httptools protocol with the limits production servers put on a client's connection
and request head (nginx: client_header_timeout, large_client_header_buffers,
client_body_timeout; Apache: mod_reqtimeout), which neither uvicorn nor httptools has:

- connections: past the cap a newcomer is answered 503 and closed; the open ones are never
  refused nor cut (uvicorn's --limit-concurrency would 503 their next requests too);
- a request head: at most `max_header_bytes` (431, then close), complete within
  `header_timeout_s` of the connection's start or of the request's first byte (else close).
  Between requests the keep-alive timeout rules, as before;
- a request body: complete within `body_timeout_s` of its head, plus one second per
  `body_min_rate` bytes received, so a body may be slow but not slower than that (else close).

A refusal (503, 431) closes lingering, as nginx does: the answer, our side shut for writing,
and what the client still sends read and dropped for up to `LINGER_S`, because closing on
unread data resets the connection and a reset can discard the answer before it is read.
"""

from __future__ import annotations

import asyncio
import http
import logging
import math
import resource
import time
from asyncio import TimerHandle
from collections import Counter, OrderedDict
from typing import Any, ClassVar

import orjson
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from proxy.http.errors import ApiError
from proxy.options import ProxyOptions

log = logging.getLogger("tether.proxy")

LINGER_S = 2.0
# Past this many refusals lingering at once, a refusal answers and closes at once.
MAX_LINGERING = 64
# Descriptors kept for everything but client connections: FIFOs, the notify and listening
# sockets, the event loop's own (17 in all at start), and the refusals lingering.
FD_RESERVE = 64 + MAX_LINGERING


def protocol_class(options: ProxyOptions) -> type[EdgeProtocol]:
    """EdgeProtocol bound to one server's limits (uvicorn makes each connection's protocol
    from a class)."""
    server_edge = Edge(options, connection_cap(options.max_connections))

    class Protocol(EdgeProtocol):
        edge = server_edge

    return Protocol


def connection_cap(max_connections: int) -> int:
    """`max_connections`, or less where the open-files limit would run out first: a process
    out of descriptors can accept nobody, answer nobody, nor ping its watchdog."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft - FD_RESERVE >= max_connections:
        log.info("at most %d open connections (open-files limit %s)", max_connections,
                 "unlimited" if soft == resource.RLIM_INFINITY else soft)
        return max_connections
    cap = max(soft - FD_RESERVE, 1)
    log.warning("at most %d open connections: the open-files limit (%d) holds no more than "
                "that, not --max-connections %d", cap, soft, max_connections)
    return cap


def _answer(status: int, message: str, code: str) -> bytes:
    body = orjson.dumps(ApiError(status, message, code=code).body())
    head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


class _Notices:
    """Connections refused or cut, counted by reason and logged at most once per `EVERY_S`
    each: a flood of hostile clients must not flood the log as well."""

    EVERY_S = 10.0

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._logged_at: dict[str, float] = {}

    def add(self, reason: str, level: int = logging.INFO) -> None:
        self.counts[reason] += 1
        now = time.monotonic()
        if now - self._logged_at.get(reason, -math.inf) >= self.EVERY_S:
            self._logged_at[reason] = now
            log.log(level, "connection %s (%d so far)", reason, self.counts[reason])


class Edge:
    """What the connections of one server share: the limits, their answers, the lingering."""

    def __init__(self, options: ProxyOptions, max_connections: int) -> None:
        self.max_connections = max_connections
        self.max_header_bytes = options.max_header_bytes
        self.header_timeout_s = options.header_timeout_s
        self.body_timeout_s = options.body_timeout_s
        self.body_min_rate = options.body_min_rate
        self.too_many = _answer(
            503, f"the server holds its limit of {max_connections} open connections; "
            "retry later on a new connection", "too_many_connections")
        self.too_large = _answer(
            431, f"the request head (request line and headers) is over the limit of "
            f"{options.max_header_bytes} bytes", "request_header_too_large")
        self.heads = _HeadClock(options.header_timeout_s)
        self.lingering: set[_Linger] = set()
        self.notices = _Notices()

    def refuse(self, transport: asyncio.Transport, answer: bytes) -> None:
        transport.write(answer)
        if len(self.lingering) < MAX_LINGERING and transport.can_write_eof():
            transport.set_protocol(_Linger(transport, self.lingering))
            transport.write_eof()
        else:
            transport.set_protocol(_Refused())
            transport.close()


class _HeadClock:
    """The head deadlines of every connection, on one timer. They share one timeout, so they
    fall due in the order they were set, which an OrderedDict keeps: a timer per connection
    would cost each of 10,000 idle connections 600 bytes more (measured)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._due: OrderedDict[EdgeProtocol, float] = OrderedDict()
        self._timer: TimerHandle | None = None

    def __contains__(self, protocol: EdgeProtocol) -> bool:
        return protocol in self._due

    def start(self, protocol: EdgeProtocol) -> None:
        self._due[protocol] = protocol.loop.time() + self.timeout_s
        if self._timer is None:
            self._timer = protocol.loop.call_at(self._due[protocol], self._expire, protocol.loop)

    def stop(self, protocol: EdgeProtocol) -> None:
        self._due.pop(protocol, None)

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time()
        while self._due:
            protocol, due = next(iter(self._due.items()))
            if due > now:
                self._timer = loop.call_at(due, self._expire, loop)
                return
            del self._due[protocol]
            protocol.head_timeout()


class _Refused(asyncio.Protocol):
    """A refused connection on its way out: what the client still sends is dropped."""

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # the transport closes


class _Linger(_Refused):
    """Until the client closes too, or for `LINGER_S` at most."""

    def __init__(self, transport: asyncio.Transport, lingering: set[_Linger]) -> None:
        self._lingering = lingering
        lingering.add(self)
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._timer.cancel()
        self._lingering.discard(self)


class EdgeProtocol(HttpToolsProtocol):
    """One connection. A request is in its head from its first byte (or the connection's
    start) until httptools has parsed the head, then in its body until the message ends."""

    edge: ClassVar[Edge]
    # Slots, not the instance dict: uvicorn's protocol already has 30 attributes, as many as an
    # instance dict shares its keys for, and 4 more would double the dict of each of 10,000
    # idle connections (+12 MB measured).
    __slots__ = ("_body_deadline", "_body_timer", "_head_bytes", "_in_body")

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._head_bytes = 0
        self._in_body = False
        self._body_timer: TimerHandle | None = None
        self._body_deadline = 0.0

    # --- the connection ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.edge.max_connections:
            self.edge.notices.add(f"refused: {self.edge.max_connections} open", logging.WARNING)
            self.edge.refuse(transport, self.edge.too_many)
            return
        super().connection_made(transport)
        self.edge.heads.start(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # The head is fed no further than its limit, so the parser never holds more of it.
        # After a body, the rest of that read goes in whole: a pipelined head that starts in
        # it is counted from the next read on.
        while data and not self._in_body:
            room = self.edge.max_header_bytes - self._head_bytes
            if room <= 0:
                self._refuse_head()
                return
            if self not in self.edge.heads and not self._responding():
                self.edge.heads.start(self)
            piece, data = data[:room], data[room:]
            self._head_bytes += len(piece)
            super().data_received(piece)
            if self._gone():
                return
        if data:
            super().data_received(data)
        if self._in_body and self._body_timer is None and not self._gone():
            self._body_timer = self.loop.call_at(self._body_deadline, self._body_timeout)

    # --- parser callbacks -------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self.edge.heads.stop(self)
        self._head_bytes = 0
        self._in_body = True
        self._body_deadline = self.loop.time() + self.edge.body_timeout_s
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_deadline += len(body) / self.edge.body_min_rate
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    # --- limits -----------------------------------------------------------------------------

    def _gone(self) -> bool:
        """Closed, or handed on (a refusal, a WebSocket upgrade): no more of this protocol."""
        return self.transport.is_closing() or self.transport.get_protocol() is not self

    def _responding(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _stop_timers(self) -> None:
        self.edge.heads.stop(self)
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def head_timeout(self) -> None:
        if not self.transport.is_closing():
            self.edge.notices.add(f"closed: no request head within "
                                  f"{self.edge.header_timeout_s:g} s")
            self.transport.close()

    def _body_timeout(self) -> None:
        self._body_timer = None
        now = self.loop.time()
        if now < self._body_deadline:  # the body came on since the timer was set
            self._body_timer = self.loop.call_at(self._body_deadline, self._body_timeout)
        elif not self.transport.is_closing():
            self.edge.notices.add("closed: request body too slow")
            self.transport.close()

    def _refuse_head(self) -> None:
        self.edge.notices.add(f"refused: request head over {self.edge.max_header_bytes} bytes")
        self._stop_timers()
        if self._responding():  # a pipelined head: no room for a 431 in the answer under way
            self.transport.close()
            return
        self.connections.discard(self)
        self._unset_keepalive_if_required()
        self.edge.refuse(self.transport, self.edge.too_large)
