"""A client on its own TCP connection that can vanish at any moment (what the abort tests drop),
its readers, and SSE parsing."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import orjson


def post_raw(port: int, path: str, body: dict[str, Any], rid: str | None = None,
             key: str | None = None, timeout: float = 60.0,
             headers: dict[str, str] | None = None) -> socket.socket:
    """Sends one POST and returns the socket without reading anything."""
    data = orjson.dumps(body)
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n")
    head += "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
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
    """Reads a chunked body until its last chunk, or until the server closes the connection."""
    got = b""
    while not got.endswith(b"0\r\n\r\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def read_plain(sock: socket.socket) -> tuple[bytes, bytes]:
    """Status line and body of a response with a Content-Length."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before the headers ended: {got!r}"
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before the body ended"
        body += chunk
    return head.split(b"\r\n")[0], body


def sse_events(raw: bytes | str) -> list[Any]:
    """Each event's data in a whole SSE body: its JSON, or the string ``[DONE]``. An ``event:``
    line, where there is one, must name the type its data carries."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    out: list[Any] = []
    for block in text.split("\n\n"):
        lines = block.strip("\r\n").split("\n")
        data = [line[6:] for line in lines if line.startswith("data: ")]
        if not data:
            continue
        event = data[0] if data[0] == "[DONE]" else orjson.loads(data[0])
        for line in lines:
            if line.startswith("event: "):
                assert isinstance(event, dict) and line[7:] == event.get("type"), block
        out.append(event)
    return out


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


def collect_events(base_url: str, method: str, path: str, events: list[dict[str, Any]],
                   body: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
                   ) -> None:
    """Reads one SSE stream to its end, appending each event's JSON as it arrives (for a reader
    thread: the caller watches `events` grow)."""
    try:
        with httpx.Client(base_url=base_url, headers=headers, timeout=60) as c:
            with c.stream(method, path, json=body) as s:
                for line in s.iter_lines():
                    event = sse_json(line)
                    if event is not None:
                        events.append(event)
    except httpx.TransportError as exc:  # the server went away mid-stream: no terminal event
        events.append({"type": "(connection lost)", "error": str(exc)})


def read_until_closed(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection. A reset ends it too: a server that
    closes with some of the client's bytes unread resets the connection."""
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def closing_error(answer: bytes, status: int) -> dict[str, Any]:
    """The OpenAI error object of an answer with `status` that closes the connection."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), answer[:300]
    assert b"connection: close" in head.lower()
    error: dict[str, Any] = orjson.loads(body)["error"]
    return error
