"""ipc.pipes on real FIFOs when a pipe is full: control records queue in order, a cancelled
submit still goes out whole, and a tokens pipe that drains slowly is a backlog, not a lost proxy."""

from __future__ import annotations

import asyncio
import fcntl
import multiprocessing
import multiprocessing.synchronize
import os
import threading
import time
from pathlib import Path

from ipc import tokens_writer
from ipc.pipes import DaemonPipes, ProxyConnection
from ipc.records import (
    PROTOCOL_VERSION,
    Abort,
    AbortCause,
    Delta,
    Finish,
    FinishReason,
    Hello,
    Submit,
    Usage,
    Welcome,
)
from tests.support.pipes_kit import FORK, drain, submit
from tests.support.wait import wait_until


def _abort_burst_child(run: Path, count: int, results: multiprocessing.Queue,
                       read: multiprocessing.synchronize.Event) -> None:
    async def main() -> int:
        up = asyncio.Event()
        pipes = ProxyConnection(run, lambda r: None, lambda loss: loss is None and up.set())
        await pipes.start()
        await asyncio.wait_for(up.wait(), 5)
        accepted = sum(pipes.control(Abort(f"r{i}:" + "x" * 1000, AbortCause.CLIENT_DISCONNECT, 7))
                       for i in range(count))
        assert pipes.pipes._control is not None
        control = pipes.pipes._control
        results.put(len(control._queue))  # what the full pipe did not take
        await wait_until(lambda: not control._queue, 10)  # drains as the daemon reads
        # Closing now would hang up on records still in the pipe (the daemon, seeing EOF on
        # requests, reopens both pipes and drops what it has not read): wait until it has.
        await wait_until(read.is_set, 10)
        await pipes.close()
        return accepted

    results.put(asyncio.run(main()))


def test_control_records_queue_in_order_while_the_pipe_is_full(tmp_path: Path) -> None:
    pipes = DaemonPipes(tmp_path)
    results: multiprocessing.Queue = FORK.Queue()
    count = 3000  # ~3 MB: three times what the 1 MiB control pipe holds
    read = FORK.Event()
    child = FORK.Process(target=_abort_burst_child, args=(tmp_path, count, results, read))
    child.start()
    try:
        hello = next(r for r in drain(pipes, time.monotonic() + 5, 1) if isinstance(r, Hello))
        pipes.send([Welcome(PROTOCOL_VERSION, os.getpid(), "m", 64, 7, hello.nonce)])
        # Not reading until the whole burst is written: the pipe fills and the rest queues.
        assert results.get(timeout=10) > 0
        got = drain(pipes, time.monotonic() + 10, count)
        read.set()
        assert results.get(timeout=10) == count
    finally:
        child.kill()
    aborts = [r.rid.split(":")[0] for r in got if isinstance(r, Abort)]
    assert aborts == [f"r{i}" for i in range(count)]
    assert pipes.bad_records["control"] == 0
    pipes.close()


# -- a frame once started is finished; a full tokens pipe is judged by progress ----------------


def _cancelling_child(run: Path, big: int, results: multiprocessing.Queue) -> None:
    async def main() -> dict[str, object]:
        states: list[bool] = []
        finished = asyncio.Event()
        up = asyncio.Event()

        def on_record(record: object) -> None:
            if isinstance(record, Finish) and record.rid == "after":
                finished.set()

        def on_state(loss: object) -> None:
            states.append(loss is None)
            if loss is None:
                up.set()

        pipes = ProxyConnection(run, on_record, on_state)
        await pipes.start()
        await asyncio.wait_for(up.wait(), 5)
        big_task = asyncio.create_task(pipes.submit(submit("big", "x" * big), timeout=30))
        await asyncio.sleep(0.3)  # the daemon is not reading: the frame is part-written
        big_task.cancel()
        queued = pipes.queue_submit(submit("withdrawn"))
        withdrawn = pipes.withdraw(queued)  # queued behind "big": never started
        await pipes.submit(submit("after"), timeout=30)
        await asyncio.wait_for(finished.wait(), 10)
        await pipes.close()
        return {"states": states, "withdrawn": withdrawn}

    results.put(asyncio.run(main()))


def test_a_cancelled_submit_still_goes_out_whole(tmp_path: Path) -> None:
    """The caller of a frame larger than the pipe gives up half-way: the frame is finished
    anyway, the connection survives, and the next frame arrives intact."""
    pipes = DaemonPipes(tmp_path)
    results: multiprocessing.Queue = FORK.Queue()
    big = 3 * 1024 * 1024
    child = FORK.Process(target=_cancelling_child, args=(tmp_path, big, results))
    child.start()
    try:
        hello = next(r for r in drain(pipes, time.monotonic() + 5, 1) if isinstance(r, Hello))
        pipes.send([Welcome(PROTOCOL_VERSION, os.getpid(), "m", 64, 7, hello.nonce)])
        time.sleep(0.8)  # a long tick: the big frame stays half-written meanwhile
        submits: list[Submit] = []
        deadline = time.monotonic() + 10
        while len(submits) < 2 and time.monotonic() < deadline:
            pipes.wait_readable(0.05)
            pipes.read_control()
            for record in pipes.read_requests():
                assert isinstance(record, Submit)
                submits.append(record)
                pipes.send([Finish(record.rid, 0, FinishReason.STOP, Usage(1, 0))])
        outcome = results.get(timeout=10)
    finally:
        child.kill()
    assert [s.rid for s in submits] == ["big", "after"] and len(submits[0].prompts[0]) == big
    assert outcome == {"states": [True], "withdrawn": True}
    assert pipes.bad_records == {"control": 0, "requests": 0}
    pipes.close()


def test_a_full_tokens_pipe_that_drains_slowly_is_not_a_lost_proxy(tmp_path: Path) -> None:
    """The proxy reads steadily but less than is written: the backlog never empties, yet it
    moves, so the proxy is not lost (only a backlog that stops moving is)."""
    pipes = DaemonPipes(tmp_path)
    reader = os.open(tmp_path / "tokens", os.O_RDONLY | os.O_NONBLOCK)
    pipes.send([])
    fcntl.fcntl(reader, 1031, 64 * 1024)  # F_SETPIPE_SZ: a small pipe fills at once
    delta = Delta("r", 0, "y" * 2000, [1])
    until = time.monotonic() + tokens_writer.MAX_STALL_S + 1.5
    while time.monotonic() < until:
        pipes.send([delta] * 10)  # ~20 KB in
        os.read(reader, 16 * 1024)  # 16 KB out
        assert pipes.take_lost() is None
        time.sleep(0.01)
    assert pipes.tokens_backlog > 0 and pipes.proxy_connected
    os.close(reader)
    pipes.close()


def test_waiting_returns_once_a_backlog_over_the_bound_is_back_under_it(tmp_path: Path) -> None:
    """The tick loop waits while the proxy reads a backlog down, and goes on as soon as it is
    under the bound, not at the end of its idle wait."""
    pipes = DaemonPipes(tmp_path)
    reader = os.open(tmp_path / "tokens", os.O_RDONLY | os.O_NONBLOCK)
    delta = Delta("r", 0, "y" * 4000, [1])
    pipes.send([delta] * 600)  # 2.4 MB: the pipe's 1 MiB and more than the bound behind it
    assert pipes.backlogged

    done = threading.Event()

    def drain() -> None:
        time.sleep(0.2)
        while not done.is_set():
            try:
                os.read(reader, 1 << 20)
            except BlockingIOError:
                time.sleep(0.001)

    reading = threading.Thread(target=drain)
    reading.start()
    t0 = time.monotonic()
    pipes.wait_readable(10.0)
    waited = time.monotonic() - t0
    done.set()
    reading.join()
    assert not pipes.backlogged and 0.15 < waited < 3.0, waited
    os.close(reader)
    pipes.close()
