from __future__ import annotations

import asyncio

import pytest
from starlette.types import Message, Receive

from proxy.http.cancellation import DisconnectWatch
from proxy.http.errors import ClientDisconnected


def receiver(messages: asyncio.Queue[Message]) -> Receive:
    async def receive() -> Message:
        return await messages.get()

    return receive


async def handler(messages: asyncio.Queue[Message], work_s: float, started: asyncio.Event,
                  cleaned: asyncio.Event | None = None) -> int:
    """A handler shaped like the proxy's: the work runs inside `with watch:`."""
    watch = DisconnectWatch(receiver(messages))
    try:
        with watch:
            started.set()
            try:
                await asyncio.sleep(work_s)
            finally:
                if cleaned is not None:
                    cleaned.set()
            return 42
    finally:
        watch.close()


@pytest.mark.anyio
async def test_work_that_finishes_returns_its_result_and_stops_watching() -> None:
    before = asyncio.all_tasks()
    assert await handler(asyncio.Queue(), 0, asyncio.Event()) == 42
    await asyncio.sleep(0)  # the watcher's cancellation completes
    assert asyncio.all_tasks() == before


@pytest.mark.anyio
async def test_disconnect_cancels_the_work_and_runs_its_cleanup() -> None:
    messages: asyncio.Queue[Message] = asyncio.Queue()
    started, cleaned = asyncio.Event(), asyncio.Event()
    task = asyncio.ensure_future(handler(messages, 60, started, cleaned))
    await started.wait()
    messages.put_nowait({"type": "http.disconnect"})
    with pytest.raises(ClientDisconnected):
        await task
    assert cleaned.is_set()


@pytest.mark.anyio
async def test_a_client_already_gone_never_starts_the_work() -> None:
    messages: asyncio.Queue[Message] = asyncio.Queue()
    messages.put_nowait({"type": "http.disconnect"})
    watch = DisconnectWatch(receiver(messages))
    await asyncio.sleep(0)  # the watcher reads the disconnect
    with pytest.raises(ClientDisconnected), watch:
        raise AssertionError("the work ran for a client that had left")
    watch.close()


@pytest.mark.anyio
async def test_cancelling_the_handler_is_not_a_disconnect_and_leaves_no_task() -> None:
    before = asyncio.all_tasks()
    started = asyncio.Event()
    task = asyncio.ensure_future(handler(asyncio.Queue(), 60, started))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == before
