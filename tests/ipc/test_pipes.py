"""ipc.pipes on real FIFOs: both directions between real processes, several concurrent control
writers, corrupt input, how a backlog is judged and systemd-inherited fds. (Creation and permissions:
test_fifo.py.)"""

from __future__ import annotations

import asyncio
import errno
import multiprocessing
import multiprocessing.synchronize
import os
import random
import select
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
    Submit,
    Usage,
    Welcome,
)
from ipc.wire import ToDaemon
from tests.support.clock import StepClock
from tests.support.pipes_kit import FORK, drain, submit
from tests.support.wait import wait_until

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
            await pipes.submit(submit(f"r{i}"))
        assert pipes.control(Abort("r3", AbortCause.CLIENT_DISCONNECT, 7, 1.0))
        await pipes.submit(submit("big", "x" * big))  # several pipe-fulls: partial writes
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
            await pipes.submit(submit("r"))
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
    got = drain(pipes, time.monotonic() + 8, writers * count)
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
    os.write(control, encode(submit("wrong-pipe")) + encode_control(abort))
    os.write(requests, encode(submit("s1")) + b'{"k":"submit","rid":1}\n' + encode(submit("s2")))
    got = drain(pipes, time.monotonic() + 2, 5)
    assert got == [abort, abort, abort, submit("s1"), submit("s2")]
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
    assert isinstance(drain(pipes, time.monotonic() + 1, 1)[0], Hello)
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
    assert drain(pipes, time.monotonic() + 1, 1) == [Hello(PROTOCOL_VERSION, 1, 5)]
    pipes.send([Delta("r", 0, "t", [2])])
    # A new connection's first byte is a newline, ending any half frame left in the pipe.
    assert os.read(reader, 4096) == b"\n" + encode(Delta("r", 0, "t", [2]))
    os.close(writer)
    os.close(reader)
    pipes.close()
