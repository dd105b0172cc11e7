"""Server-sent events framing and a streaming response that always closes its body."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from proxy.http.cancellation import DisconnectWatch
from proxy.http.errors import ClientDisconnected

DONE = b"data: [DONE]\n\n"

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# U+0085, U+2028 and U+2029 are legal raw in JSON strings, and orjson leaves them raw, but
# clients that split a stream with str.splitlines() (httpx's iter_lines among them) end an SSE
# line there and get half an event. In UTF-8 these byte strings can only be those characters,
# and in JSON text they can only be inside a string, so escaping them is always safe.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"),
                (b"\xe2\x80\xa9", b"\\u2029"))


def sse_json(data: Any) -> bytes:
    """`data` as JSON for one SSE data line: no byte of it that any client reads as a line end."""
    payload = orjson.dumps(data)
    if b"\xc2\x85" in payload or b"\xe2\x80" in payload:
        for raw, escaped in _LINE_BREAKS:
            payload = payload.replace(raw, escaped)
    return payload


def sse_event(data: dict[str, Any], event: str | None = None) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + sse_json(data) + b"\n\n"


class SSEResponse(StreamingResponse):
    """A StreamingResponse that stops at a disconnect and closes its body however it ends
    (the readers of a background response).

    The body is streamed in the handler's own task under a `DisconnectWatch`: no task group and
    no second streaming task per response. A disconnect cancels the streaming where it waits.
    If the body generator was suspended at a ``yield`` (the task was inside ``send``), nothing
    resumes it and its ``finally`` would only run when the garbage collector finds it: closing
    it here runs that ``finally`` at once.
    """

    def __init__(self, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = DisconnectWatch(receive)
        try:
            with watch:
                await self._stream(send)
        except ClientDisconnected:
            pass  # nobody is left to answer
        finally:
            watch.close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                # A body whose cleanup is synchronous finishes without suspending, so a
                # pending cancellation cannot interrupt it.
                await aclose()
        if self.background is not None:
            await self.background()

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            body = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
