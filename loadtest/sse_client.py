"""A minimal asyncio HTTP/1.1 client for the benchmarks.

The benchmark client shares two cores with the server, so it stays close to the socket: one
connection per request, chunked transfer decoding, SSE ``data:`` payloads split on blank
lines. ``close()`` drops the TCP connection at once, which is how a client "goes away".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import orjson


class HttpError(Exception):
    """A non-2xx answer; carries the status and the body."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300]!r}")
        self.status = status
        self.body = body


@dataclasses.dataclass(slots=True, frozen=True)
class Endpoint:
    host: str
    port: int

    @classmethod
    def from_url(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or 80)


class Response:
    """One request's response, read incrementally."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.status = 0
        self.headers: dict[str, str] = {}
        self.closed_at: float | None = None
        self._ended = False

    async def read_head(self) -> None:
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split(" ", 2)[1])
        for line in lines[1:]:
            if ":" in line:
                key, value = line.split(":", 1)
                self.headers[key.strip().lower()] = value.strip()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (transfer decoding undone)."""
        if self._ended:
            return
        if not self.status:
            await self.read_head()
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self.reader.readline()).split(b";", 1)[0], 16)
                if size == 0:
                    await self.reader.readline()
                    break
                data = await self.reader.readexactly(size + 2)
                yield data[:-2]
        elif "content-length" in self.headers:
            yield await self.reader.readexactly(int(self.headers["content-length"]))
        else:
            while data := await self.reader.read(65536):
                yield data
        self._ended = True

    async def body(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    async def events(self) -> AsyncIterator[bytes]:
        """SSE ``data:`` payloads, ``[DONE]`` included."""
        buf = b""
        async for chunk in self.chunks():
            buf += chunk.replace(b"\r\n", b"\n") if b"\r" in chunk else chunk
            *complete, buf = buf.split(b"\n\n")
            for event in complete:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        yield line[5:].lstrip(b" ")

    async def count_events(self) -> int:
        """Blank-line-terminated events, without parsing them (the cheapest reader)."""
        count, last = 0, b""
        async for chunk in self.chunks():
            count += (last + chunk).count(b"\n\n")
            last = chunk[-1:]
        return count

    def close(self) -> None:
        if self.closed_at is None:
            self.closed_at = time.monotonic()
            self.writer.close()


async def send(base_url: str, method: str, path: str, body: dict[str, Any] | None = None,
               headers: dict[str, str] | None = None) -> Response:
    """Send one request without waiting for the answer (a server may hold back its headers
    until the first token, e.g. while the request is queued); call `read_head()` later."""
    ep = Endpoint.from_url(base_url)
    reader, writer = await asyncio.open_connection(ep.host, ep.port)
    payload = orjson.dumps(body) if body is not None else b""
    head = [f"{method} {path} HTTP/1.1", f"Host: {ep.host}:{ep.port}", "Connection: close",
            f"Content-Length: {len(payload)}"]
    if body is not None:
        head.append("Content-Type: application/json")
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
    await writer.drain()
    return Response(reader, writer)


async def request(base_url: str, method: str, path: str, body: dict[str, Any] | None = None,
                  headers: dict[str, str] | None = None) -> Response:
    """Send one request and read the status line and headers; the body is left to the caller."""
    resp = await send(base_url, method, path, body, headers)
    try:
        await resp.read_head()
    except BaseException:
        resp.close()
        raise
    return resp


@contextlib.asynccontextmanager
async def stream(base_url: str, path: str, body: dict[str, Any]) -> AsyncIterator[Response]:
    """POST and hand back the open response; the connection is dropped on leaving the block."""
    resp = await request(base_url, "POST", path, body, {"Accept": "text/event-stream"})
    try:
        if resp.status >= 300:
            raise HttpError(resp.status, await resp.body())
        yield resp
    finally:
        resp.close()


async def call_json(base_url: str, method: str, path: str,
                    body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """One request, whole JSON body back (None when the body is not JSON)."""
    resp = await request(base_url, method, path, body)
    try:
        raw = await resp.body()
    finally:
        resp.close()
    try:
        return resp.status, orjson.loads(raw)
    except orjson.JSONDecodeError:
        return resp.status, None


def tokens_in_event(obj: dict[str, Any]) -> int:
    """Tokens an OpenAI stream event delivers.

    One per choice delta carrying text (chat ``delta.content``, completions ``text``), or the
    length of ``token_ids`` / ``logprobs.content`` when the server sends them; Responses API
    ``response.output_text.delta`` events count one each.
    """
    if obj.get("type") == "response.output_text.delta":
        return 1
    total = 0
    for choice in obj.get("choices") or ():
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            total += len(ids)
            continue
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if text:
            total += 1
    return total
