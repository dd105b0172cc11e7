"""Stop a handler's work the moment its client disconnects.

The handler reads the request body first; after that the only message ``receive()`` can deliver
is ``http.disconnect``, so one task waiting on it is the disconnect signal. Polling
``request.is_disconnected()`` would add latency and breaks under BaseHTTPMiddleware.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.types import Receive

from proxy.errors import ClientDisconnected

T = TypeVar("T")


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


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
        # wait_for_disconnect inlined: one coroutine frame less per held request.
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


async def run_until_disconnect(request: Request, coro: Coroutine[Any, Any, T]) -> T:
    """Runs `coro` until it finishes or the client leaves, whichever comes first.

    On a disconnect the work is cancelled (its ``finally`` blocks write the Abort) and
    ClientDisconnected is raised. The body must already have been read.
    """
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Also reached when this task itself is cancelled: never leave either task behind.
        await _cancel(watch)
        if not work.done():
            await _cancel(work)
    if work.cancelled():
        raise ClientDisconnected()
    return work.result()


async def _cancel(task: asyncio.Future[Any]) -> None:
    if task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
