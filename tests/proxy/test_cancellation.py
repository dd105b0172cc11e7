from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request
from starlette.types import Message

from proxy.cancellation import run_until_disconnect
from proxy.errors import ClientDisconnected


def request_with(messages: asyncio.Queue[Message]) -> Request:
    async def receive() -> Message:
        return await messages.get()

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


@pytest.mark.anyio
async def test_work_that_finishes_returns_its_result_and_stops_watching() -> None:
    messages: asyncio.Queue[Message] = asyncio.Queue()
    before = asyncio.all_tasks()

    async def work() -> int:
        await asyncio.sleep(0)
        return 42

    assert await run_until_disconnect(request_with(messages), work()) == 42
    assert asyncio.all_tasks() == before


@pytest.mark.anyio
async def test_disconnect_cancels_the_work_and_runs_its_cleanup() -> None:
    messages: asyncio.Queue[Message] = asyncio.Queue()
    cleaned = asyncio.Event()
    started = asyncio.Event()

    async def work() -> int:
        started.set()
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.set()
        return 0

    task = asyncio.ensure_future(run_until_disconnect(request_with(messages), work()))
    await started.wait()
    messages.put_nowait({"type": "http.disconnect"})
    with pytest.raises(ClientDisconnected):
        await task
    assert cleaned.is_set()


@pytest.mark.anyio
async def test_errors_of_the_work_propagate() -> None:
    messages: asyncio.Queue[Message] = asyncio.Queue()

    async def work() -> int:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await run_until_disconnect(request_with(messages), work())


@pytest.mark.anyio
async def test_cancelling_the_handler_leaves_no_task_behind() -> None:
    messages: asyncio.Queue[Message] = asyncio.Queue()
    before = asyncio.all_tasks()
    started = asyncio.Event()

    async def work() -> int:
        started.set()
        await asyncio.sleep(60)
        return 0

    task = asyncio.ensure_future(run_until_disconnect(request_with(messages), work()))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert asyncio.all_tasks() == before
