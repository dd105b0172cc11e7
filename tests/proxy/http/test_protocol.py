"""EdgeProtocol driven by hand: bytes in through data_received, a transport that records what
goes out. The exact bounds here; the same limits on real processes in tests/e2e/."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import orjson
import pytest
import uvicorn
from uvicorn.server import ServerState

from proxy.http import protocol as http_protocol
from proxy.http.protocol import Edge, EdgeProtocol, protocol_class
from tests.support.options import proxy_options

pytestmark = pytest.mark.anyio

LIMIT = 1024
GET = b"GET /health HTTP/1.1\r\nHost: x\r\n"


class Transport(asyncio.Transport):
    def __init__(self, protocol: asyncio.BaseProtocol | None = None) -> None:
        super().__init__()
        self.protocol = protocol or asyncio.Protocol()
        self.written = b""
        self.closed = False
        self.eof = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5000)}.get(name)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.protocol

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body and answers with its length."""
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = orjson.dumps({"body_bytes": size})
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _server(**limits: Any) -> type[EdgeProtocol]:
    return protocol_class(dataclasses.replace(proxy_options(max_header_bytes=LIMIT), **limits))


def _connect(state: ServerState | None = None, cls: type[EdgeProtocol] | None = None,
             **limits: Any) -> tuple[EdgeProtocol, Transport]:
    config = uvicorn.Config(app, lifespan="off", log_config=None)  # type: ignore[arg-type]
    config.load()
    protocol = (cls or _server(**limits))(config, state or ServerState(), {})
    transport = Transport(protocol)
    protocol.connection_made(transport)
    return protocol, transport


def _head(size: int) -> bytes:
    """A GET whose head is `size` bytes, final blank line included."""
    return GET + b"X-Pad: " + b"a" * (size - len(GET) - len(b"X-Pad: \r\n\r\n")) + b"\r\n\r\n"


async def _served(transport: Transport, count: int = 1) -> None:
    for _ in range(200):
        if transport.written.count(b"HTTP/1.1 200") >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not served: {transport.written[:300]!r}")


def _refused(transport: Transport, status: bytes) -> dict[str, Any]:
    head, _, body = transport.written.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 " + status) and b"connection: close" in head, head
    assert transport.eof and not transport.closed  # lingering: our side shut, reading on
    assert not isinstance(transport.protocol, EdgeProtocol)
    error: dict[str, Any] = orjson.loads(body)["error"]
    return error


async def test_a_head_of_exactly_the_limit_is_served() -> None:
    protocol, transport = _connect()
    protocol.data_received(_head(LIMIT))
    await _served(transport)


async def test_one_byte_past_the_limit_gets_431() -> None:
    protocol, transport = _connect()
    protocol.data_received(_head(LIMIT + 1))
    error = _refused(transport, b"431")
    assert error["code"] == "request_header_too_large" and str(LIMIT) in error["message"]


async def test_a_head_in_many_reads_is_counted_whole() -> None:
    protocol, transport = _connect()
    head = _head(LIMIT + 1)
    for i in range(0, len(head), 7):
        protocol.data_received(head[i:i + 7])
    _refused(transport, b"431")


async def test_an_unfinished_head_is_refused_once_past_the_limit() -> None:
    protocol, transport = _connect()
    protocol.data_received(GET + b"X-Huge: " + b"a" * (10 * LIMIT))
    _refused(transport, b"431")
    assert isinstance(transport.protocol, asyncio.Protocol)
    transport.protocol.data_received(b"a" * LIMIT)  # what comes after is dropped
    assert transport.written.count(b"HTTP/1.1") == 1


async def test_a_body_does_not_count_as_head() -> None:
    protocol, transport = _connect()
    body = b"x" * (8 * LIMIT)
    protocol.data_received(b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: "
                           + str(len(body)).encode() + b"\r\n\r\n" + body)
    await _served(transport)
    assert b'{"body_bytes":8192}' in transport.written


async def test_each_pipelined_head_has_its_own_limit() -> None:
    protocol, transport = _connect()
    protocol.data_received(_head(LIMIT - 10) + _head(LIMIT - 10))
    await _served(transport, 2)


async def test_a_newcomer_past_the_cap_gets_503_and_is_never_counted() -> None:
    state = ServerState()
    first, _ = _connect(state, max_connections=2)
    second, _ = _connect(state, max_connections=2)
    _, transport = _connect(state, max_connections=2)
    error = _refused(transport, b"503")
    assert error["code"] == "too_many_connections" and "2 open" in error["message"]
    assert state.connections == {first, second}


async def test_refusals_linger_only_so_many_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_protocol, "MAX_LINGERING", 2)
    edge = Edge(proxy_options(), max_connections=1)
    refused = [Transport() for _ in range(3)]
    for transport in refused:
        edge.refuse(transport, b"no")
    assert [t.written for t in refused] == [b"no"] * 3
    assert [t.eof for t in refused] == [True, True, False]
    assert refused[2].closed  # past the bound: answered and closed at once
    assert len(edge.lingering) == 2
    refused[0].protocol.connection_lost(None)  # the client closed too
    assert len(edge.lingering) == 1


async def test_a_connection_that_sends_no_head_in_time_is_closed() -> None:
    _, transport = _connect(header_timeout_s=0.05)
    await asyncio.sleep(0.3)
    assert transport.closed and transport.written == b""


async def test_head_deadlines_of_many_connections_fall_due_each_in_turn() -> None:
    cls = _server(header_timeout_s=0.2)
    early = [_connect(cls=cls)[1] for _ in range(3)]
    await asyncio.sleep(0.1)
    late_protocol, late = _connect(cls=cls)
    served_protocol, served = _connect(cls=cls)
    served_protocol.data_received(_head(100))
    await asyncio.sleep(0.15)
    assert all(t.closed for t in early) and not late.closed
    await asyncio.sleep(0.2)
    assert late.closed and not served.closed
    late_protocol.connection_lost(None)
    assert late_protocol not in cls.edge.heads and served_protocol not in cls.edge.heads


async def test_the_header_timer_stops_once_the_head_is_in() -> None:
    protocol, transport = _connect(header_timeout_s=0.05)
    protocol.data_received(_head(100))
    await _served(transport)
    await asyncio.sleep(0.3)  # idle between requests: the keep-alive timeout's business
    assert not transport.closed
    protocol.data_received(GET)  # the next request's first bytes start the clock again
    await asyncio.sleep(0.3)
    assert transport.closed


async def test_a_stalled_body_is_closed_after_its_timeout() -> None:
    protocol, transport = _connect(body_timeout_s=0.1, body_min_rate=1000)
    protocol.data_received(b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nxx")
    await asyncio.sleep(0.5)
    assert transport.closed and b"HTTP/1.1" not in transport.written


async def test_each_body_byte_buys_time_at_the_minimum_rate() -> None:
    """0.1 s to start with, 10 ms more per byte at 100 bytes/s: 20 bytes every 50 ms keep
    ahead of the deadline for well past the timeout."""
    protocol, transport = _connect(body_timeout_s=0.1, body_min_rate=100)
    protocol.data_received(b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 200\r\n\r\n")
    for _ in range(10):
        protocol.data_received(b"x" * 20)
        await asyncio.sleep(0.05)
        assert not transport.closed
    await _served(transport)
    assert b'{"body_bytes":200}' in transport.written
