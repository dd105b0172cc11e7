"""Stop a handler's work the moment its client disconnects.

The handler reads the request body first; after that the only message ``receive()`` can deliver
is ``http.disconnect``, so one task waiting on it is the disconnect signal. Polling
``request.is_disconnected()`` would add latency and breaks under BaseHTTPMiddleware.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from starlette.types import Receive

from proxy.http.errors import ClientDisconnected


class DisconnectWatch:
    """One task awaiting ``receive()`` for the whole request; the work runs in the handler's
    own task, and a disconnect cancels that task while it is inside a ``with watch:`` block.

    Cheaper than a task per awaited step: a held stream costs this object and one small task,
    and a plain ``with`` keeps no coroutine frame alive. Cancellation is only requested while
    the handler is suspended inside the block, so it always lands there; leaving the block it
    becomes ClientDisconnected (cleanups run as it unwinds).
    """

    __slots__ = ("_armed", "_cancelled", "_handler", "_task", "gone")

    def __init__(self, receive: Receive) -> None:
        self.gone = False  # the client has left
        self._armed = False  # the handler is inside the with block
        self._cancelled = False  # we asked for the handler's cancellation
        handler = asyncio.current_task()
        assert handler is not None, "DisconnectWatch needs a running task"
        self._handler = handler
        self._task: asyncio.Task[None] | None = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self._armed and not self._cancelled:
            self._cancelled = True
            self._handler.cancel()

    def __enter__(self) -> DisconnectWatch:
        if self.gone:
            raise ClientDisconnected()
        self._armed = True
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._armed = False
        if self._cancelled and exc_type is not None and issubclass(exc_type,
                                                                   asyncio.CancelledError):
            self._cancelled = False
            if self._handler.uncancel() == 0:  # else someone else cancelled us too: theirs wins
                raise ClientDisconnected() from None

    def close(self) -> None:
        """Stops watching; call before the handler returns (no await in between)."""
        self._armed = False
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
