"""ipc.pipes on real FIFOs: both directions between real processes, several concurrent control
writers, corrupt input, how a backlog is judged and systemd-inherited fds. (Creation and permissions:
test_fifo.py.)"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import multiprocessing
import multiprocessing.synchronize
import os
import random
import select
import threading
import time
from pathlib import Path

import pytest

from ipc import daemon_side, tokens_writer
from ipc.framing import encode, encode_control
from ipc.pipes import DaemonPipes, DaemonUnavailable, LossReason, ProxyConnection, ensure_fifos
from ipc.records import (
    PROTOCOL_VERSION,
    Abort,
    AbortCause,
    Delta,
    Finish,
    FinishReason,
    Hello,
    RequestKind,
    SamplingParams,
    Submit,
    Usage,
    Welcome,
)
from ipc.wire import ToDaemon
from tests.support.clock import StepClock
from tests.support.wait import wait_until

FORK = multiprocessing.get_context("fork")


def _submit(rid: str, prompt: str = "hello") -> Submit:
    return Submit(rid=rid, epoch=7, kind=RequestKind.COMPLETION, sampling=SamplingParams(),
                  prompts=[prompt])


def _drain(pipes: DaemonPipes, until: float, want: int) -> list[ToDaemon]:
    got: list[ToDaemon] = []
    while time.monotonic() < until and len(got) < want:
        pipes.wait_readable(0.05)
        got += pipes.read_control()
        got += pipes.read_requests()
    return got


# -- proxy (child process) <-> daemon (this process) ------------------------------------------


def _proxy_child(run: Path, big: int, results: multiprocessing.Queue) -> None:
    async def main() -> list[str]:
        got: list[str] = []
        finished = asyncio.Event()
        up = asyncio.Event()

        def on_record(record: object) -> None:
            got.append(type(record).__name__)
            if isinstance(record, Finish) and record.rid == "big":
                finished.set()

        pipes = ProxyConnection(run, on_record, lambda loss: loss is None and up.set())
        await pipes.start()
        await asyncio.wait_for(up.wait(), 5)
        for i in range(50):
            await pipes.submit(_submit(f"r{i}"))
        assert pipes.control(Abort("r3", AbortCause.CLIENT_DISCONNECT, 7, 1.0))
        await pipes.submit(_submit("big", "x" * big))  # several pipe-fulls: partial writes
        await asyncio.wait_for(finished.wait(), 5)
        await pipes.close()
        return got

    results.put(asyncio.run(main()))


def test_round_trip_between_proxy_and_daemon_processes(tmp_path: Path) -> None:
    pipes = DaemonPipes(tmp_path)
    results: multiprocessing.Queue = FORK.Queue()
    big = 3 * 1024 * 1024
    child = FORK.Process(target=_proxy_child, args=(tmp_path, big, results))
    child.start()
    try:
        seen: list[ToDaemon] = []
        deadline = time.monotonic() + 8
        while child.is_alive() and time.monotonic() < deadline:
            pipes.wait_readable(0.05)
            for record in pipes.read_control() + pipes.read_requests():
                seen.append(record)
                if isinstance(record, Hello):
                    assert record.version == PROTOCOL_VERSION
                    pipes.send([Welcome(PROTOCOL_VERSION, os.getpid(), "m", 64, 7, record.nonce)])
                elif isinstance(record, Submit):
                    pipes.send([Delta(record.rid, 0, "hi", [1]),
                                Finish(record.rid, 0, FinishReason.STOP, Usage(1, 1))])
        names = results.get(timeout=1)
        child.join(5)
    finally:
        child.kill()
    submits = [r for r in seen if isinstance(r, Submit)]
    assert [r.rid for r in submits] == [f"r{i}" for i in range(50)] + ["big"]
    assert len(submits[-1].prompts[0]) == big
    assert any(isinstance(r, Abort) and r.rid == "r3" for r in seen)
    assert names.count("Delta") == 51 and names.count("Finish") == 51
    assert names[0] == "Welcome"
    assert pipes.bad_records == {"control": 0, "requests": 0}
    pipes.close()


def test_proxy_without_daemon_stays_down(tmp_path: Path) -> None:
    paths = ensure_fifos(tmp_path)
    with pytest.raises(OSError) as exc:
        os.open(paths["control"], os.O_WRONLY | os.O_NONBLOCK)
    assert exc.value.errno == errno.ENXIO

    async def main() -> None:
        states: list[object] = []
        pipes = ProxyConnection(tmp_path, lambda r: None, states.append)
        attempts: list[None] = []
        connect = pipes._connect
        pipes._connect = lambda: (attempts.append(None), connect())[1]  # type: ignore[method-assign]
        await pipes.start()
        await wait_until(lambda: len(attempts) >= 3)  # it keeps trying, and stays down
        assert not pipes.up and not pipes.connected and states == []
        assert pipes.control(Abort("r", AbortCause.CANCEL, 1)) is False
        with pytest.raises(DaemonUnavailable):
            await pipes.submit(_submit("r"))
        await pipes.close()

    asyncio.run(main())


# -- the daemon side against raw writers and readers ------------------------------------------


def _control_writer(path: Path, writer: int, count: int, seed: int) -> None:
    rng = random.Random(seed)
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    for seq in range(count):
        # rid lengths up to nearly PIPE_BUF: a torn write would show up as a corrupt frame.
        rid = f"{writer}:{seq}:" + "x" * rng.choice((0, 10, 500, 2000, 3900))
        frame = encode_control(Abort(rid, AbortCause.CLIENT_DISCONNECT, writer))
        while True:
            try:
                assert os.write(fd, frame) == len(frame)
                break
            except BlockingIOError:
                select.select([], [fd], [], 1.0)
    os.close(fd)


def test_concurrent_control_writers_never_interleave(tmp_path: Path) -> None:
    pipes = DaemonPipes(tmp_path)
    writers, count = 4, 3000
    procs = [FORK.Process(target=_control_writer, args=(tmp_path / "control", w, count, w))
             for w in range(writers)]
    for proc in procs:
        proc.start()
    got = _drain(pipes, time.monotonic() + 8, writers * count)
    for proc in procs:
        proc.join(5)
    assert len(got) == writers * count
    assert pipes.bad_records["control"] == 0
    for w in range(writers):
        seqs = [int(r.rid.split(":")[1]) for r in got if isinstance(r, Abort) and r.epoch == w]
        assert seqs == list(range(count))  # each writer's records arrive whole and in order
    pipes.close()


def test_corrupt_bytes_are_counted_and_neighbours_survive(tmp_path: Path) -> None:
    pipes = DaemonPipes(tmp_path)
    control = os.open(tmp_path / "control", os.O_WRONLY | os.O_NONBLOCK)
    requests = os.open(tmp_path / "requests", os.O_WRONLY | os.O_NONBLOCK)
    abort = Abort("a", AbortCause.CANCEL, 1)
    os.write(control, encode_control(abort) + b"\x00\xff{garbage\n" + encode_control(abort))
    os.write(control, encode(_submit("wrong-pipe")) + encode_control(abort))
    os.write(requests, encode(_submit("s1")) + b'{"k":"submit","rid":1}\n' + encode(_submit("s2")))
    got = _drain(pipes, time.monotonic() + 2, 5)
    assert got == [abort, abort, abort, _submit("s1"), _submit("s2")]
    assert pipes.bad_records == {"control": 2, "requests": 1}
    os.close(control)
    os.close(requests)
    pipes.close()


def test_tokens_backlog_is_judged_by_progress_never_by_size(tmp_path: Path) -> None:
    clock = StepClock()
    pipes = DaemonPipes(tmp_path, clock=clock)
    reader = os.open(tmp_path / "tokens", os.O_RDONLY | os.O_NONBLOCK)  # never reads
    delta = Delta("r", 0, "y" * 4000, [1])
    pipes.send([delta])
    assert pipes.proxy_connected and not pipes.backlogged
    for _ in range(30):  # 12 MB, however large: the tick loop keeps it bounded (backlogged)
        pipes.send([delta] * 100)
    assert pipes.take_lost() is None and pipes.proxy_connected
    assert pipes.backlogged and pipes.tokens_backlog > daemon_side.BACKLOG_BOUND_BYTES
    clock.advance(tokens_writer.MAX_STALL_S + 0.01)
    pipes.send([])
    lost = pipes.take_lost()
    assert lost is not None and lost.reason is LossReason.STALLED_READER
    assert not pipes.proxy_connected and pipes.tokens_backlog == 0 and not pipes.backlogged
    pipes.send([delta])
    assert pipes.num_dropped >= 1  # no proxy until it says Hello again

    control = os.open(tmp_path / "control", os.O_WRONLY | os.O_NONBLOCK)
    os.write(control, encode_control(Hello(PROTOCOL_VERSION, 1, 1)))
    assert isinstance(_drain(pipes, time.monotonic() + 1, 1)[0], Hello)
    os.close(reader)
    reader = os.open(tmp_path / "tokens", os.O_RDONLY | os.O_NONBLOCK)
    clock.advance(tokens_writer.TOKENS_RETRY_S)
    pipes.send([delta] * 300)  # more than the pipe holds
    assert pipes.proxy_connected and pipes.tokens_backlog > 0
    clock.advance(tokens_writer.MAX_STALL_S - 0.01)
    pipes.send([])
    assert pipes.take_lost() is None  # not a moment early
    clock.advance(0.02)
    pipes.send([])
    lost = pipes.take_lost()
    assert lost is not None and lost.reason is LossReason.STALLED_READER
    assert "took nothing" in lost.detail
    os.close(reader)
    os.close(control)
    pipes.close()


def test_inherited_fds_are_used_instead_of_paths(tmp_path: Path) -> None:
    paths = ensure_fifos(tmp_path / "systemd")
    # What systemd's ListenFIFO= hands over: O_RDWR fds, so no EOF or ENXIO ever.
    fds = {name: os.open(path, os.O_RDWR | os.O_NONBLOCK) for name, path in paths.items()}
    pipes = DaemonPipes(tmp_path / "unused", inherited=dict(fds))
    assert not (tmp_path / "unused").exists()
    writer = os.open(paths["control"], os.O_WRONLY | os.O_NONBLOCK)
    reader = os.open(paths["tokens"], os.O_RDONLY | os.O_NONBLOCK)
    pipes.send([Delta("early", 0, "", [])])
    assert not pipes.proxy_connected  # a systemd-held pipe proves no reader: wait for Hello
    os.write(writer, encode_control(Hello(PROTOCOL_VERSION, 1, 5)))
    assert _drain(pipes, time.monotonic() + 1, 1) == [Hello(PROTOCOL_VERSION, 1, 5)]
    pipes.send([Delta("r", 0, "t", [2])])
    # A new connection's first byte is a newline, ending any half frame left in the pipe.
    assert os.read(reader, 4096) == b"\n" + encode(Delta("r", 0, "t", [2]))
    os.close(writer)
    os.close(reader)
    pipes.close()


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
        hello = next(r for r in _drain(pipes, time.monotonic() + 5, 1) if isinstance(r, Hello))
        pipes.send([Welcome(PROTOCOL_VERSION, os.getpid(), "m", 64, 7, hello.nonce)])
        # Not reading until the whole burst is written: the pipe fills and the rest queues.
        assert results.get(timeout=10) > 0
        got = _drain(pipes, time.monotonic() + 10, count)
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
        big_task = asyncio.create_task(pipes.submit(_submit("big", "x" * big), timeout=30))
        await asyncio.sleep(0.3)  # the daemon is not reading: the frame is part-written
        big_task.cancel()
        queued = pipes.queue_submit(_submit("withdrawn"))
        withdrawn = pipes.withdraw(queued)  # queued behind "big": never started
        await pipes.submit(_submit("after"), timeout=30)
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
        hello = next(r for r in _drain(pipes, time.monotonic() + 5, 1) if isinstance(r, Hello))
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
