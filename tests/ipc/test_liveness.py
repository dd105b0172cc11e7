"""Each side notices when the other process dies, hangs or speaks another protocol version,
and the proxy reconnects when a new daemon appears. Real processes, killed for real."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ipc.connection import proxy as proxy_connection
from ipc.framing import encode_control
from ipc.pipes import DaemonPipes, Loss, LossReason, ProxyConnection
from ipc.records import (
    PROTOCOL_VERSION,
    SILENCE_TIMEOUT_S,
    Delta,
    Heartbeat,
    Hello,
    RequestKind,
    SamplingParams,
    Submit,
    Welcome,
)
from ipc.wire import ToDaemon, ToProxy
from tests.support.clock import StepClock

REPO = Path(__file__).resolve().parents[2]
FORK = multiprocessing.get_context("fork")

# A minimal engine stand-in: welcomes each Hello, answers a Submit with its prompt reversed
# and sends Stats every 50 ms like the real daemon's tick loop; told to be "busy", it goes into
# a 10 s "forward pass" once welcomed, sending nothing itself.
_ECHO_DAEMON = """
import os, sys, time
from pathlib import Path
from ipc.pipes import DaemonPipes
from ipc.records import Delta, Hello, Welcome
from ipc.stats import Stats
run, version, busy = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "busy"
pipes = DaemonPipes(run)
next_stats = 0.0
while True:
    pipes.wait_readable(0.02)
    out = [Welcome(version, os.getpid(), "echo", 64, r.epoch, r.nonce)
           for r in pipes.read_control() if isinstance(r, Hello)]
    out += [Delta(r.rid, 0, r.prompts[0][::-1], []) for r in pipes.read_requests()]
    if time.monotonic() >= next_stats:
        next_stats = time.monotonic() + 0.05
        out.append(Stats(time.monotonic(), 0, 0, 0, 0, 0, 0, 0, 0, 0, {}, {}, {}))
    pipes.send(out)
    if busy and any(isinstance(r, Welcome) for r in out):
        time.sleep(10.0)
"""


def _start_daemon(run: Path, version: int = PROTOCOL_VERSION,
                  busy: bool = False) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    args = [sys.executable, "-c", _ECHO_DAEMON, str(run), str(version),
            "busy" if busy else "idle"]
    return subprocess.Popen(args, env=env)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()


class _Proxy:
    """ProxyConnection plus queues of what it reported, for awaiting in tests."""

    def __init__(self, run: Path) -> None:
        self.states: asyncio.Queue[Loss | None] = asyncio.Queue()
        self.records: asyncio.Queue[ToProxy] = asyncio.Queue()
        self.pipes = ProxyConnection(run, self.records.put_nowait, self.states.put_nowait)

    async def state(self, within: float = 5.0) -> Loss | None:
        """The next change: None once connected, else the Loss."""
        return await asyncio.wait_for(self.states.get(), within)

    async def lost(self, within: float = 5.0) -> Loss:
        loss = await self.state(within)
        assert loss is not None, "connected where a loss was expected"
        return loss

    async def echo(self, rid: str, prompt: str) -> str:
        submit = Submit(rid=rid, kind=RequestKind.COMPLETION, sampling=SamplingParams(),
                        prompts=[prompt])
        await self.pipes.submit(submit)
        while True:
            record = await asyncio.wait_for(self.records.get(), 5)
            if isinstance(record, Delta) and record.rid == rid:
                return record.text


def test_proxy_sees_daemon_killed_and_reconnects_to_a_new_one(tmp_path: Path) -> None:
    async def main() -> None:
        daemon = _start_daemon(tmp_path)
        proxy = _Proxy(tmp_path)
        await proxy.pipes.start()
        try:
            assert await proxy.state() is None  # connected
            assert await proxy.echo("a", "abc") == "cba"
            _kill(daemon)
            loss = await proxy.lost(2.0)
            assert loss.reason in (LossReason.EOF, LossReason.EPIPE)
            assert "EOF" in loss.detail or "EPIPE" in loss.detail
            assert not proxy.pipes.up
            daemon = _start_daemon(tmp_path)
            assert await proxy.state() is None
            assert await proxy.echo("b", "xyz") == "zyx"
            assert proxy.pipes.bad_records == 0
        finally:
            await proxy.pipes.close()
            _kill(daemon)

    asyncio.run(main())


def test_proxy_declares_a_hung_daemon_lost(tmp_path: Path) -> None:
    async def main() -> None:
        daemon = _start_daemon(tmp_path)
        proxy = _Proxy(tmp_path)
        await proxy.pipes.start()
        try:
            assert await proxy.state() is None
            os.kill(daemon.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            loss = await proxy.lost(SILENCE_TIMEOUT_S + 3.0)
            assert loss.reason is LossReason.SILENCE and "no record from the daemon" in loss.detail
            assert SILENCE_TIMEOUT_S - 0.1 < time.monotonic() - t0 < SILENCE_TIMEOUT_S + 2.0
        finally:
            await proxy.pipes.close()
            _kill(daemon)

    asyncio.run(main())


def test_a_proxy_stalled_past_the_bound_reads_before_it_judges(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy stopped just as its silence timer fired wakes with the daemon's records waiting
    in the tokens pipe, not yet polled: that is not silence. (The bound is shortened so that
    the daemon's own 3 s heartbeat bound does not fire during the stall.)"""
    monkeypatch.setattr(proxy_connection, "SILENCE_S", 0.5)

    async def main() -> None:
        daemon = _start_daemon(tmp_path)
        proxy = _Proxy(tmp_path)
        check = proxy.pipes._check

        def stalled(now: float) -> float:
            if proxy.pipes.up and not stalls:
                stalls.append(now)
                time.sleep(1.0)  # the stop; the daemon's Stats pile up in the pipe
            return check(time.monotonic())

        stalls: list[float] = []
        monkeypatch.setattr(proxy.pipes, "_check", stalled)
        await proxy.pipes.start()
        try:
            assert await proxy.state() is None
            for _ in range(100):
                if stalls:
                    break
                await asyncio.sleep(0.05)
            assert await proxy.echo("a", "abc") == "cba"  # past the stall
            assert stalls and proxy.pipes.up and proxy.states.empty()
        finally:
            await proxy.pipes.close()
            _kill(daemon)

    asyncio.run(main())


def test_a_stop_between_an_empty_read_and_the_clock_is_not_silence(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon stopped (SIGSTOP) just after a read found the control pipe empty wakes to
    heartbeats waiting in it: that is not silence, however long the stop."""
    clock = StepClock()
    pipes = DaemonPipes(tmp_path, clock=clock, heartbeat_timeout=3.0)
    control = os.open(tmp_path / "control", os.O_WRONLY | os.O_NONBLOCK)
    os.write(control, encode_control(Hello(PROTOCOL_VERSION, 1, 1)))
    assert [type(r) for r in pipes.read_control()] == [Hello]
    read = pipes._control.read

    def read_then_stopped() -> tuple[list[ToDaemon], bool]:
        got = read()
        clock.advance(5.0)  # the stop: the proxy goes on heartbeating meanwhile
        os.write(control, encode_control(Heartbeat(1, clock())))
        return got

    monkeypatch.setattr(pipes._control, "read", read_then_stopped)
    assert pipes.read_control() == []
    assert pipes.take_lost() is None
    monkeypatch.undo()
    assert [type(r) for r in pipes.read_control()] == [Heartbeat]
    clock.advance(2.99)  # the bound itself still holds, counted from the heartbeat's read
    assert pipes.read_control() == [] and pipes.take_lost() is None
    clock.advance(0.02)
    assert pipes.read_control() == []
    lost = pipes.take_lost()
    assert lost is not None and lost.reason is LossReason.SILENCE
    assert "no heartbeat from the proxy for 3 s" in lost.detail
    os.close(control)
    pipes.close()


def test_a_long_forward_pass_is_not_silence(tmp_path: Path) -> None:
    """The busy daemon's loop sends nothing for 10 s; its keepalive thread speaks for it."""
    async def main() -> None:
        daemon = _start_daemon(tmp_path, busy=True)
        proxy = _Proxy(tmp_path)
        await proxy.pipes.start()
        try:
            assert await proxy.state() is None
            with pytest.raises(TimeoutError):
                await proxy.state(SILENCE_TIMEOUT_S + 2.0)
            assert proxy.pipes.up
        finally:
            await proxy.pipes.close()
            _kill(daemon)

    asyncio.run(main())


def test_proxy_refuses_a_daemon_with_another_protocol_version(tmp_path: Path) -> None:
    async def main() -> None:
        daemon = _start_daemon(tmp_path, version=PROTOCOL_VERSION + 1)
        proxy = _Proxy(tmp_path)
        await proxy.pipes.start()
        try:
            loss = await proxy.lost()
            assert loss.reason is LossReason.VERSION_MISMATCH
            assert f"daemon {PROTOCOL_VERSION + 1}, proxy {PROTOCOL_VERSION}" in loss.detail
            assert proxy.records.empty()
        finally:
            await proxy.pipes.close()
            _kill(daemon)

    asyncio.run(main())


def _idle_proxy(run: Path) -> None:
    async def main() -> None:
        pipes = ProxyConnection(run, lambda r: None, lambda loss: None)
        await pipes.start()
        await asyncio.sleep(60)

    asyncio.run(main())


def _await_hello(pipes: DaemonPipes, timeout: float = 5.0) -> Hello:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pipes.wait_readable(0.05)
        pipes.read_requests()
        for record in pipes.read_control():
            if isinstance(record, Hello):
                pipes.send([Welcome(PROTOCOL_VERSION, os.getpid(), "m", 64, record.epoch + 8,
                                    record.nonce)])
                return record
    raise AssertionError("no Hello from the proxy")


def _await_lost(pipes: DaemonPipes, timeout: float) -> Loss:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pipes.wait_readable(0.05)
        pipes.read_control()
        pipes.read_requests()
        pipes.send([])
        lost = pipes.take_lost()
        if lost is not None:
            return lost
    raise AssertionError("the daemon never noticed the proxy was gone")


def test_daemon_sees_proxy_killed_and_does_not_spin(tmp_path: Path) -> None:
    pipes = DaemonPipes(tmp_path)
    proxy = FORK.Process(target=_idle_proxy, args=(tmp_path,))
    proxy.start()
    try:
        assert _await_hello(pipes).epoch == 1  # its proposal: its last epoch (none) + 1
        assert pipes.proxy_connected
        os.kill(proxy.pid, signal.SIGKILL)
        t0 = time.monotonic()
        lost = _await_lost(pipes, 2.0)
        assert lost.reason is LossReason.EOF and "EOF" in lost.detail
        assert time.monotonic() - t0 < 0.5
        assert not pipes.proxy_connected and pipes.take_lost() is None
        # Hung-up fds are reopened, so an idle loop really waits instead of spinning on HUP.
        loops, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 0.3:
            pipes.wait_readable(0.1)
            assert pipes.read_control() == [] and pipes.read_requests() == []
            loops += 1
        assert loops <= 5 and pipes.take_lost() is None
        # A new proxy is welcomed as usual.
        proxy.join(1)
        proxy = FORK.Process(target=_idle_proxy, args=(tmp_path,))
        proxy.start()
        assert _await_hello(pipes).epoch == 1
    finally:
        proxy.kill()
        pipes.close()


def test_daemon_drops_a_hung_proxy_which_then_resyncs(tmp_path: Path) -> None:
    pipes = DaemonPipes(tmp_path, heartbeat_timeout=0.5)
    proxy = FORK.Process(target=_idle_proxy, args=(tmp_path,))
    proxy.start()
    try:
        _await_hello(pipes)
        os.kill(proxy.pid, signal.SIGSTOP)
        lost = _await_lost(pipes, 2.0)
        assert lost.reason is LossReason.SILENCE and "no heartbeat" in lost.detail
        os.kill(proxy.pid, signal.SIGCONT)
        # The proxy reads EOF on tokens (we closed it), reconnects and says Hello again.
        _await_hello(pipes, 3.0)
        assert pipes.proxy_connected
    finally:
        proxy.kill()
        pipes.close()


def test_daemon_ignores_writers_that_never_said_hello(tmp_path: Path) -> None:
    pipes = DaemonPipes(tmp_path)
    fd = os.open(tmp_path / "control", os.O_WRONLY | os.O_NONBLOCK)
    os.write(fd, encode_control(Hello(PROTOCOL_VERSION, 1, 1))[:10])  # half a frame, then gone
    os.close(fd)
    pipes.wait_readable(0.5)
    assert pipes.read_control() == []
    assert pipes.take_lost() is None  # nobody had connected, so nobody was lost
    fd = os.open(tmp_path / "control", os.O_WRONLY | os.O_NONBLOCK)
    os.write(fd, encode_control(Hello(PROTOCOL_VERSION, 1, 2)))
    assert _await_hello(pipes).epoch == 2  # the stale half frame was dropped with the old fd
    os.close(fd)
    pipes.close()
