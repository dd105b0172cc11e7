"""Stop a non-streaming handler's work the moment its client disconnects.

The handler reads the request body first; after that the only message ``receive()`` can deliver
is ``http.disconnect``, so one task waiting on it is the disconnect signal. Polling
``request.is_disconnected()`` would add latency and breaks under BaseHTTPMiddleware.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
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
