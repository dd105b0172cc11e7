"""A client on its own TCP connection that can vanish at any moment (what the abort tests drop),
and SSE parsing."""

from __future__ import annotations

import socket
from typing import Any

import orjson


def post_raw(port: int, path: str, body: dict[str, Any], rid: str | None = None,
             key: str | None = None, timeout: float = 60.0) -> socket.socket:
    """Sends one POST and returns the socket without reading anything."""
    data = orjson.dumps(body)
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n")
    if rid:
        head += f"X-Request-Id: {rid}\r\n"
    if key:
        head += f"Authorization: Bearer {key}\r\n"
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.sendall(head.encode() + b"\r\n" + data)
    return sock


def read_events(sock: socket.socket, count: int) -> bytes:
    """Reads the SSE stream until `count` data events arrived (chunk framing never holds 'data: ')."""
    got = b""
    while got.count(b"data: ") < count:
        chunk = sock.recv(65536)
        assert chunk, f"stream ended early: {got[-500:]!r}"
        got += chunk
    return got


def read_to_end(sock: socket.socket) -> bytes:
    """Reads a chunked response until its last chunk (or until the server closes)."""
    got = b""
    while not got.endswith(b"0\r\n\r\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def sse_json(line: str) -> dict[str, Any] | None:
    """The JSON of one SSE ``data:`` line; None for other lines and ``[DONE]``."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return orjson.loads(line[6:])  # type: ignore[no-any-return]


def response_id_from_stream(raw: bytes) -> str:
    """The response id in a raw Responses stream's ``response.created`` event."""
    for line in raw.split(b"\n"):
        if line.startswith(b"data: ") and b'"response.created"' in line:
            return str(orjson.loads(line[6:])["response"]["id"])
    raise AssertionError(f"no response.created event in {raw[:500]!r}")
