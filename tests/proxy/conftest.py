"""A scripted daemon on real FIFOs, and the proxy app driven in-process or on a real port.

`Peer` is the daemon's side of the real `ipc.pipes.DaemonPipes`, run in a thread: it answers
Hello with Welcome, plays every Submit as a fixed script (one token per sequence per step,
"tok<k> " with logprob -0.25 when asked, until max_tokens; a prompt "echo:<text>" makes every
token "<text>"), applies Aborts, Pauses and Resumes, and sends Stats. Prompts containing
"TOO LONG" are rejected with a context-length Error record, as the real daemon does.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from ipc.pipes import DaemonPipes
from ipc.records import (
    PROTOCOL_VERSION,
    Abort,
    Delta,
    Error,
    Finish,
    FinishReason,
    Hello,
    Pause,
    RequestKind,
    Resume,
    Stats,
    Submit,
    ToDaemon,
    TokenLogprob,
    ToProxy,
    Usage,
    Welcome,
)
from proxy.app import create_app
from proxy.server import ProxyServer, build_server
from tether.settings import Settings

MODEL = "test-model"
MAX_MODEL_LEN = 4096
PROMPT_TOKENS = 3
CACHED_TOKENS = 2  # what the scripted daemon says its prefix cache held of each prompt


@dataclass
class Session:
    submit: Submit
    unfinished: set[int]
    produced: dict[int, int] = field(default_factory=dict)
    echo: str | None = None
    paused: bool = False


class Peer:
    def __init__(self, runtime_dir: Path, step_s: float = 0.005) -> None:
        self.runtime_dir = runtime_dir
        self.step_s = step_s
        self.hold = False  # when set, Submits stay queued (no records) until cleared
        self.submits: list[Submit] = []
        self.aborts: list[Abort] = []
        self.flow: list[Pause | Resume] = []
        self.finished: list[str] = []  # rids that finished normally
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._pipes = DaemonPipes(runtime_dir, heartbeat_timeout=None)
        self._thread = threading.Thread(target=self._run, name="test-daemon-peer", daemon=True)
        self._next_stats = 0.0

    def start(self) -> Peer:
        self._thread.start()
        return self

    def stop(self) -> None:
        """The daemon dies: its pipe ends close, the proxy sees EOF."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(5)
            self._pipes.close()

    def wait_for(self, cond: Callable[[Peer], object], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not cond(self):
                remaining = deadline - time.monotonic()
                assert remaining > 0, "timed out waiting on the test daemon"
                self._lock.wait(remaining)

    def key_of(self, client_id: str, timeout: float = 5.0) -> str:
        """The engine key the proxy gave the request sent with this X-Request-Id."""
        self.wait_for(lambda p: any(s.client_id == client_id for s in p.submits), timeout)
        return next(s.rid for s in self.submits if s.client_id == client_id)

    # --- the daemon loop (thread) ---------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._pipes.wait_readable(self.step_s)
            out: list[ToProxy] = []
            with self._lock:
                for record in self._pipes.read_control() + self._pipes.read_requests():
                    out += self._handle(record)
                if not self.hold:
                    out += self._step()
                now = time.monotonic()
                if now >= self._next_stats:
                    self._next_stats = now + 0.1
                    out.append(self._stats(now))
                self._lock.notify_all()
            self._pipes.send(out)

    def _handle(self, record: ToDaemon) -> list[ToProxy]:
        if isinstance(record, Hello):
            return [Welcome(PROTOCOL_VERSION, os.getpid(), MODEL, MAX_MODEL_LEN, record.epoch,
                            record.nonce)]
        if isinstance(record, Pause | Resume):
            self.flow.append(record)
            if record.rid in self._sessions:
                self._sessions[record.rid].paused = isinstance(record, Pause)
            return []
        if isinstance(record, Abort):
            self.aborts.append(record)
            session = self._sessions.pop(record.rid, None)
            if session is None:
                return []
            return [Finish(record.rid, i, FinishReason.ABORT, Usage(PROMPT_TOKENS, 0),
                           cause=record.cause) for i in sorted(session.unfinished)]
        if isinstance(record, Submit):
            self.submits.append(record)
            text = " ".join(record.prompts) + " ".join(m.content for m in record.messages)
            if record.response is not None:
                text += " ".join(str(item.get("content")) for item in record.response.input_items)
            if "TOO LONG" in text:
                return [Error(record.rid, f"the prompt is longer than {MAX_MODEL_LEN} tokens",
                              status=400, param="messages" if record.messages else "prompt",
                              code="context_length_exceeded")]
            count = len(record.prompts) * record.n if record.kind is RequestKind.COMPLETION \
                else record.n
            echo = text[5:] if text.startswith("echo:") else None
            self._sessions[record.rid] = Session(record, set(range(count)), echo=echo)
        return []

    def _step(self) -> list[ToProxy]:
        out: list[ToProxy] = []
        for rid, session in list(self._sessions.items()):
            if session.paused:
                continue
            for index in sorted(session.unfinished):
                k = session.produced.get(index, 0)
                text = f"tok{k} " if session.echo is None else session.echo
                n = session.submit.sampling.logprobs
                logprobs = None if n is None else [
                    TokenLogprob(text.encode(), -0.25, [(text.encode(), -0.25), (b"alt", -1.5)][:n])]
                out.append(Delta(rid, index, text, [k], logprobs))
                session.produced[index] = k + 1
                if k + 1 >= session.submit.sampling.max_tokens:
                    session.unfinished.discard(index)
                    out.append(Finish(rid, index, FinishReason.LENGTH,
                                      Usage(PROMPT_TOKENS, k + 1, CACHED_TOKENS)))
            if not session.unfinished:
                del self._sessions[rid]
                self.finished.append(rid)
        return out

    def _stats(self, now: float) -> Stats:
        causes: dict[str, int] = {}
        for abort in self.aborts:
            causes[abort.cause.value] = causes.get(abort.cause.value, 0) + 1
        return Stats(t=now, running=0 if self.hold else len(self._sessions),
                     waiting=len(self._sessions) if self.hold else 0, kv_blocks_used=0,
                     kv_blocks_total=64, placeholders=0, ticks=0, prompt_tokens=0,
                     generation_tokens=0, tokens_after_disconnect=0, aborts=causes,
                     finished={"abort": len(self.aborts)}, bad_records=self._pipes.bad_records,
                     abort_latency_obs=[0.002] if self.aborts else [])


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(runtime_dir=tmp_path / "run", state_dir=tmp_path / "state", port=0,
                    model=MODEL)


@pytest.fixture
def peer(settings: Settings) -> Iterator[Peer]:
    p = Peer(settings.runtime_dir).start()
    yield p
    p.stop()


async def wait_until(cond: Callable[[], object], timeout: float = 5.0) -> None:  # noqa: ASYNC109
    import anyio

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await anyio.sleep(0.01)


@pytest.fixture
async def client(settings: Settings, peer: Peer) -> AsyncIterator[httpx.AsyncClient]:
    """The app in-process (lifespan run by hand), connected to the test daemon."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        await wait_until(lambda: app.state.engine.up)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            yield c


@dataclass
class LiveProxy:
    server: ProxyServer
    thread: threading.Thread
    notes: list[str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    @property
    def port(self) -> int:
        port = self.server.port
        assert port is not None
        return port


def start_live(settings: Settings) -> LiveProxy:
    notes: list[str] = []
    server = build_server(settings, notes.append)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while "READY=1" not in notes:
        assert thread.is_alive() and time.monotonic() < deadline, "the proxy did not start"
        time.sleep(0.01)
    return LiveProxy(server, thread, notes)


def stop_live(live: LiveProxy) -> None:
    live.server.should_exit = True
    live.thread.join(15)
    assert not live.thread.is_alive()


@pytest.fixture
def live(settings: Settings, peer: Peer) -> Iterator[LiveProxy]:
    """The proxy on uvicorn on a real port, in a thread, connected to the test daemon."""
    proxy = start_live(settings)
    deadline = time.monotonic() + 10
    while httpx.get(proxy.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, "the proxy never reached the test daemon"
        time.sleep(0.02)
    yield proxy
    stop_live(proxy)
