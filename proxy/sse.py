"""Server-sent events framing and a streaming response that always closes its body."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + payload + b"\n\n"


class SSEResponse(StreamingResponse):
    """A StreamingResponse that closes its body iterator however the response ends.

    Starlette cancels the task streaming the body when the client disconnects. If the body
    generator was suspended at a ``yield`` (the task was inside ``send``), nothing resumes it and
    its ``finally`` would only run when the garbage collector finds it. Closing it here runs
    that ``finally`` (which writes the Abort) at once.
    """

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str] | None = None,
                 status_code: int = 200) -> None:
        super().__init__(content, status_code=status_code, media_type="text/event-stream",
                         headers={**SSE_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                # A body whose cleanup is synchronous finishes without suspending, so the
                # pending cancellation cannot interrupt it.
                await aclose()
