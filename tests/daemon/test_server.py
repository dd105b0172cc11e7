"""The daemon's tick loop on real FIFOs; the test plays the proxy with raw FIFO ends."""

from __future__ import annotations

import errno
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from daemon.engine.core import Engine
from daemon.model.tokenizer import ByteTokenizer
from daemon.responses.store import ResponseStore
from daemon.server import DaemonServer
from ipc.framing import FrameDecoder, encode, encode_control
from ipc.pipes import DaemonPipes, ensure_fifos
from ipc.reasons import Reason
from ipc.records import (
    PROTOCOL_VERSION,
    Abort,
    AbortCause,
    Admitted,
    Error,
    Finish,
    FinishReason,
    Goodbye,
    Heartbeat,
    Hello,
    Pause,
    RequestKind,
    Resume,
    SamplingParams,
    Submit,
    Welcome,
)
from ipc.stats import Stats
from ipc.wire import ToProxy
from tests.support.fake_runner import FakeRunner

TOK = ByteTokenizer()
F_SETPIPE_SZ = 1031


class RawProxy:
    """The proxy's ends of the three FIFOs, opened the way the real proxy opens them."""

    def __init__(self, runtime_dir: Path) -> None:
        paths = ensure_fifos(runtime_dir)
        self.tokens = os.open(paths["tokens"], os.O_RDONLY | os.O_NONBLOCK)
        self.control = self._open_writer(paths["control"])
        self.requests = self._open_writer(paths["requests"])
        self.decoder: FrameDecoder[ToProxy] = FrameDecoder("tokens", ToProxy)
        self.received: list[ToProxy] = []

    @staticmethod
    def _open_writer(path: Path) -> int:
        deadline = time.monotonic() + 5
        while True:
            try:
                return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:  # ENXIO until the daemon has its read end open
                if e.errno != errno.ENXIO or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def send(self, rec: object) -> None:
        if isinstance(rec, Submit):
            os.write(self.requests, encode(rec))
        else:
            os.write(self.control, encode_control(rec))  # type: ignore[arg-type]

    def wait_for(self, pred: Callable[[ToProxy], bool], timeout: float = 5.0) -> ToProxy:
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for rec in self.received[seen:]:
                if pred(rec):
                    return rec
            seen = len(self.received)
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no matching record in {timeout} s; last: "
                                     f"{[type(r).__name__ for r in self.received[-5:]]}")
            select.select([self.tokens], [], [], min(left, 0.05))
            try:
                data = os.read(self.tokens, 1 << 16)
            except BlockingIOError:
                continue
            self.received += list(self.decoder.feed(data))

    def wait_eof(self, timeout: float = 5.0) -> None:
        """Reads tokens until the daemon has closed its end (what it does to a lost proxy)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            select.select([self.tokens], [], [], 0.05)
            try:
                data = os.read(self.tokens, 1 << 16)
            except BlockingIOError:
                continue
            if not data:
                return
            self.received += list(self.decoder.feed(data))
        raise AssertionError(f"the daemon kept the tokens pipe open for {timeout} s")

    def close(self) -> None:
        for fd in (self.control, self.requests, self.tokens):
            os.close(fd)


def completion(rid: str, epoch: int = 1, **params) -> Submit:
    return Submit(rid, RequestKind.COMPLETION, SamplingParams(**params), prompts=["hi"], epoch=epoch)


def finish_of(rid: str) -> Callable[[ToProxy], bool]:
    return lambda r: isinstance(r, Finish) and r.rid == rid


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[DaemonServer, RawProxy, list[str]]]:
    notes: list[str] = []
    servers: list[DaemonServer] = []
    result: list[int] = []
    ready = threading.Event()

    def serve() -> None:
        # A file, so that a test can open the same store as another replica.
        store = ResponseStore(tmp_path / "store.db", 100, 3600.0)
        runner = FakeRunner(64, TOK.vocab_size, lambda ctx: ord("x"), delay_s=0.002)
        engine = Engine(runner, TOK, store, 8, 64, 512, "fake")
        pipes = DaemonPipes(tmp_path / "run")
        servers.append(DaemonServer(engine, pipes, store, drain_timeout_s=0.3,
                                    notify=notes.append))
        ready.set()
        try:
            result.append(servers[0].serve())
        finally:
            pipes.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(5)
    proxy = RawProxy(tmp_path / "run")
    yield servers[0], proxy, notes
    servers[0].request_stop()
    servers[0].request_stop(force=True)
    thread.join(5)
    assert result == [0]
    proxy.close()


def hello(proxy: RawProxy, epoch: int = 1, nonce: int | None = None) -> Welcome:
    """A new connection's Hello (its own nonce), proposing `epoch`; the daemon's Welcome."""
    nonce = epoch if nonce is None else nonce
    proxy.send(Hello(PROTOCOL_VERSION, os.getpid(), epoch, nonce))
    welcome = proxy.wait_for(lambda r: isinstance(r, Welcome) and r.nonce == nonce)
    assert isinstance(welcome, Welcome)
    return welcome


def test_hello_submit_stream_and_finish(daemon):
    _server, proxy, notes = daemon
    welcome = hello(proxy)
    assert (welcome.model, welcome.max_model_len) == ("fake", 512)
    proxy.send(completion("a", max_tokens=5))
    fin = proxy.wait_for(finish_of("a"))
    assert isinstance(fin, Finish) and fin.reason is FinishReason.LENGTH
    assert fin.usage.completion_tokens == 5
    assert "READY=1" in notes and "WATCHDOG=1" in notes


def test_stats_flow_while_idle(daemon):
    _, proxy, _ = daemon
    hello(proxy)
    first = proxy.wait_for(lambda r: isinstance(r, Stats))
    second = proxy.wait_for(lambda r: isinstance(r, Stats) and r is not first)
    assert isinstance(first, Stats) and isinstance(second, Stats)
    assert second.t - first.t < 0.5 and second.kv_blocks_total == 64


def test_version_mismatch_is_an_error_naming_both_versions(daemon, caplog):
    _, proxy, _ = daemon
    hello(proxy)  # opens the tokens pipe for the daemon
    proxy.send(Hello(PROTOCOL_VERSION + 1, os.getpid(), 2))
    err = proxy.wait_for(lambda r: isinstance(r, Error) and r.rid is None)
    assert isinstance(err, Error)
    assert f"proxy {PROTOCOL_VERSION + 1}" in err.message
    assert f"daemon {PROTOCOL_VERSION}" in err.message


def test_abort_from_control_ends_generation(daemon):
    _server, proxy, _ = daemon
    hello(proxy)
    proxy.send(completion("a", max_tokens=400, ignore_eos=True))
    proxy.wait_for(lambda r: isinstance(r, Stats) and r.running == 1)
    t_disconnect = time.monotonic()
    proxy.send(Abort("a", AbortCause.CLIENT_DISCONNECT, 1, t_disconnect))
    fin = proxy.wait_for(finish_of("a"))
    assert isinstance(fin, Finish) and fin.cause is AbortCause.CLIENT_DISCONNECT
    stats = proxy.wait_for(lambda r: isinstance(r, Stats) and bool(r.abort_latency_obs))
    assert isinstance(stats, Stats) and 0 < stats.abort_latency_obs[0] < 1.0


def test_heartbeat_silence_aborts_with_proxy_lost(daemon):
    server, proxy, _ = daemon
    server.pipes.heartbeat_timeout = 0.5
    hello(proxy)
    proxy.send(Heartbeat(1, time.monotonic()))
    proxy.send(completion("a", max_tokens=490, ignore_eos=True))  # > 0.5 s of ticks
    proxy.wait_for(lambda r: isinstance(r, Stats) and r.running == 1)
    # A silent proxy is a lost one: the daemon stops writing to it until it says hello again.
    proxy.wait_eof()
    hello(proxy)
    stats = proxy.wait_for(lambda r: isinstance(r, Stats) and r.aborts.get("proxy_lost") == 1)
    assert isinstance(stats, Stats) and (stats.running, stats.kv_blocks_used) == (0, 0)


def test_new_epoch_aborts_the_old_proxys_requests(daemon):
    _, proxy, _ = daemon
    hello(proxy, epoch=1)
    proxy.send(completion("old", epoch=1, max_tokens=300, ignore_eos=True))
    proxy.wait_for(lambda r: isinstance(r, Stats) and r.running == 1)
    hello(proxy, epoch=2)
    fin = proxy.wait_for(finish_of("old"))
    assert isinstance(fin, Finish) and fin.cause is AbortCause.PROXY_LOST


def test_only_submits_of_the_current_epoch_are_admitted(daemon):
    _, proxy, _ = daemon
    old = hello(proxy, epoch=1).epoch
    new = hello(proxy, epoch=1, nonce=2).epoch  # a new connection: a new, higher epoch
    assert new > old
    proxy.send(completion("stale", epoch=old, max_tokens=300))
    fin = proxy.wait_for(finish_of("stale"))
    assert isinstance(fin, Finish) and fin.cause is AbortCause.PROXY_LOST
    proxy.send(completion("fresh", epoch=new, max_tokens=3))
    assert proxy.wait_for(lambda r: isinstance(r, Admitted) and r.rid == "fresh")
    stats = proxy.wait_for(lambda r: isinstance(r, Stats) and r.aborts.get("proxy_lost") == 1)
    assert isinstance(stats, Stats) and stats.finished.get("abort") == 1


def test_a_goodbye_acts_only_for_the_current_epoch(daemon):
    _, proxy, _ = daemon
    old = hello(proxy, epoch=1).epoch
    epoch = hello(proxy, epoch=1, nonce=2).epoch
    proxy.send(completion("a", epoch=epoch, max_tokens=400, ignore_eos=True))
    proxy.wait_for(lambda r: isinstance(r, Stats) and r.running == 1)
    proxy.send(Goodbye(old))  # a stale goodbye: nothing happens
    proxy.send(Pause("a", epoch))
    proxy.wait_for(lambda r: isinstance(r, Stats) and r.paused == 1 and r.running == 1)
    proxy.send(Resume("a", epoch))
    proxy.wait_for(lambda r: isinstance(r, Stats) and r.paused == 0 and r.running == 1)
    proxy.send(Goodbye(epoch))
    fin = proxy.wait_for(finish_of("a"))
    assert isinstance(fin, Finish) and fin.cause is AbortCause.PROXY_LOST
    proxy.send(completion("late", epoch=epoch))  # written before the goodbye, read after
    late = proxy.wait_for(finish_of("late"))
    assert isinstance(late, Finish) and late.cause is AbortCause.PROXY_LOST


def test_stop_drains_then_aborts_with_shutdown(daemon):
    server, proxy, _ = daemon
    hello(proxy)
    proxy.send(completion("short", max_tokens=3))
    proxy.send(completion("long", max_tokens=400, ignore_eos=True))
    proxy.wait_for(finish_of("short"))
    server.drain_timeout_s = 60.0  # the drain must outlast the late submit on a busy machine
    server.request_stop()
    proxy.send(completion("late"))
    err = proxy.wait_for(lambda r: isinstance(r, Error) and r.rid == "late")
    assert isinstance(err, Error) and err.reason is Reason.SHUTTING_DOWN
    server.request_stop(force=True)  # the second signal: abort what is left
    fin = proxy.wait_for(finish_of("long"))
    assert isinstance(fin, Finish) and fin.cause is AbortCause.SHUTDOWN


def test_run_loads_the_model_and_exits_0_on_sigterm(tmp_path: Path):
    from tether.sdnotify import NotifyListener

    listener = NotifyListener()
    code = ("import sys, logging; from pathlib import Path; logging.basicConfig(); "
            "from daemon.main import run; from tether.options import daemon_options; "
            "from tether.settings import Settings; "
            "from tether.sdnotify import notify; "
            f"sys.exit(run(daemon_options(Settings(runtime_dir=Path({str(tmp_path / 'run')!r}), "
            f"state_dir=Path({str(tmp_path / 'state')!r}), kv_cache_blocks=64, "
            "drain_timeout_s=0.5)), notify=notify))")
    env = dict(os.environ, NOTIFY_SOCKET=listener.name)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env,
                            cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 60
        fields: dict[str, str] = {}
        while "READY" not in fields and time.monotonic() < deadline:
            select.select([listener], [], [], 0.1)
            for note in listener.receive():
                fields.update(note.fields)
        assert fields.get("READY") == "1"
        proxy = RawProxy(tmp_path / "run")
        hello(proxy)
        proxy.send(completion("a", max_tokens=4))
        fin = proxy.wait_for(finish_of("a"), timeout=30)
        assert isinstance(fin, Finish) and fin.usage.completion_tokens > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        proxy.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        listener.close()
    assert (tmp_path / "state" / "responses.sqlite3").exists()
