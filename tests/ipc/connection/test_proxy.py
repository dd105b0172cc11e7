"""ProxyConnection against real DaemonPipes in the same process: the connection owns the epoch,
and what it queued dies with it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from ipc.pipes import DaemonPipes, DaemonUnavailable, Loss, LossReason, ProxyConnection
from ipc.records import (
    PROTOCOL_VERSION,
    Abort,
    AbortCause,
    Hello,
    Pause,
    RequestKind,
    SamplingParams,
    Submit,
    Welcome,
)
from ipc.wire import ToDaemon
from tests.support.wait import wait_until


def submit(rid: str, prompt: str = "x", epoch: int = 0) -> Submit:
    return Submit(rid, RequestKind.COMPLETION, SamplingParams(), prompts=[prompt], epoch=epoch)


async def welcome(daemon: DaemonPipes, proxy: ProxyConnection, epoch: int) -> None:
    """Answer the proxy's Hello with `epoch`, and wait until it is up."""
    hellos: list[Hello] = []

    def said_hello() -> bool:
        hellos.extend(r for r in daemon.read_control() if isinstance(r, Hello))
        return bool(hellos)

    await wait_until(said_hello)
    daemon.send([Welcome(PROTOCOL_VERSION, os.getpid(), "m", 64, epoch, hellos[-1].nonce)])
    await wait_until(lambda: proxy.up)


async def read(daemon: DaemonPipes, want: int) -> list[ToDaemon]:
    """The next `want` records but Hellos and Heartbeats, from both pipes."""
    got: list[ToDaemon] = []

    def enough() -> bool:
        got.extend(r for r in daemon.read_control() + daemon.read_requests()
                   if isinstance(r, Submit | Abort | Pause))
        return len(got) >= want

    await wait_until(enough)
    return got


def test_records_carry_the_epoch_of_the_connection_they_are_written_on(tmp_path: Path) -> None:
    async def main() -> None:
        daemon = DaemonPipes(tmp_path)
        proxy = ProxyConnection(tmp_path, lambda r: None, lambda loss: None)
        await proxy.start()
        try:
            await welcome(daemon, proxy, 7)
            assert proxy.epoch == 7
            await proxy.submit(submit("a", epoch=3))  # what the caller put there does not count
            assert proxy.control(Abort("a", AbortCause.CANCEL))
            assert proxy.control(Pause("a"))
            got = await read(daemon, 3)
            assert sorted((type(r).__name__, r.epoch) for r in got) == [
                ("Abort", 7), ("Pause", 7), ("Submit", 7)]
        finally:
            await proxy.close()
            daemon.close()

    asyncio.run(main())


def test_a_submit_queued_on_a_lost_connection_is_never_written_on_the_next(
        tmp_path: Path) -> None:
    async def main() -> None:
        daemon = DaemonPipes(tmp_path)
        states: list[Loss | None] = []
        proxy = ProxyConnection(tmp_path, lambda r: None, states.append)
        await proxy.start()
        try:
            await welcome(daemon, proxy, 1)
            proxy.queue_submit(submit("big", "x" * (3 << 20)))  # more than the pipe holds
            late = proxy.queue_submit(submit("late"))
            assert not late.started
            waiting = asyncio.ensure_future(proxy.pipes.wait(late))
            daemon.close()  # the daemon dies with the Submit still queued behind "big"
            with pytest.raises(DaemonUnavailable):
                await asyncio.wait_for(waiting, 5)
            assert len(states) == 2 and states[1] is not None and not proxy.up
            assert states[1].reason in (LossReason.EOF, LossReason.EPIPE)
            daemon = DaemonPipes(tmp_path)
            await welcome(daemon, proxy, 2)
            await proxy.submit(submit("fresh"))
            [fresh] = await read(daemon, 1)
            assert isinstance(fresh, Submit) and (fresh.rid, fresh.epoch) == ("fresh", 2)
            assert daemon.read_requests() == []
        finally:
            await proxy.close()
            daemon.close()

    asyncio.run(main())
