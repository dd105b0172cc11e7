"""A scripted daemon on real FIFOs, for the proxy's own tests.

`Peer` is the daemon's side of the real `ipc.pipes.DaemonPipes`, run in a thread: it answers
Hello with Welcome, plays every Submit as a fixed script (one token per sequence per step,
"tok<k> " with logprob -0.25 when asked, until max_tokens, or ROOM tokens when it is None; a
prompt "echo:<text>" makes every token "<text>"), answers a tokenize Submit with the prompt's
UTF-8 bytes as ids and a detokenize one with its ids as bytes, applies Aborts, Pauses and
Resumes, and sends Stats. Prompts containing
"TOO LONG" are rejected with a context-length Error record, as the real daemon does. A
ResponseOp is answered 404: it is read after every control record written before it, so a test
can use one as a barrier.

It stands in for the daemon only where a test is about the proxy: what the proxy writes and how
it renders what it reads. Daemon rules (eviction, the store's placeholders, figures) are proven on
the real daemon in tests/e2e.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ipc.pipes import DaemonPipes
from ipc.records import (
    PROTOCOL_VERSION,
    Abort,
    Delta,
    Error,
    Finish,
    FinishReason,
    Goodbye,
    Hello,
    Pause,
    RequestKind,
    Resume,
    Submit,
    TokenLogprob,
    Usage,
    Welcome,
)
from ipc.response_records import ResponseOp, ResponseReply
from ipc.stats import Stats
from ipc.wire import ToDaemon, ToProxy

MODEL = "test-model"
MAX_MODEL_LEN = 4096
PROMPT_TOKENS = 3
CACHED_TOKENS = 2  # what the scripted daemon says its prefix cache held of each prompt
ROOM = 16  # what it plays for a request without max_tokens (the rest of its "context")


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
        self.answer_ops = True  # when cleared, ResponseOps go unanswered (kept in held_ops)
        self.held_ops: list[ResponseOp] = []
        self.submits: list[Submit] = []
        self.aborts: list[Abort] = []
        self.flow: list[Pause | Resume] = []
        self.goodbyes: list[int] = []  # epochs of proxies that closed cleanly (their last record)
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

    def produced(self, rid: str) -> int:
        """Tokens played so far for the open session with this engine key or X-Request-Id."""
        return sum(sum(s.produced.values()) for s in self._sessions.values()
                   if rid in (s.submit.rid, s.submit.client_id))

    # --- the daemon loop (thread) ---------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._pipes.wait_readable(self.step_s)
            out: list[ToProxy] = []
            with self._lock:
                held, self.held_ops = (self.held_ops, []) if self.answer_ops else ([], self.held_ops)
                for record in held + self._pipes.read_control() + self._pipes.read_requests():
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
        if isinstance(record, Goodbye):
            self.goodbyes.append(record.epoch)
        if isinstance(record, ResponseOp):
            if not self.answer_ops:
                self.held_ops.append(record)
                return []
            return [ResponseReply(record.op_id, 404, message=f"{record.subject} not found")]
        if isinstance(record, Submit):
            self.submits.append(record)
            text = " ".join(record.prompts) + " ".join(m.content for m in record.messages)
            if record.response is not None:
                text += " ".join(m.content for m in record.response.input)
            if record.kind is RequestKind.TOKENIZE or record.kind is RequestKind.DETOKENIZE:
                return self._tokenize(record, text)
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
                if k + 1 >= (session.submit.sampling.max_tokens or ROOM):
                    session.unfinished.discard(index)
                    out.append(Finish(rid, index, FinishReason.LENGTH,
                                      Usage(PROMPT_TOKENS, k + 1, CACHED_TOKENS)))
            if not session.unfinished:
                del self._sessions[rid]
                self.finished.append(rid)
        return out

    @staticmethod
    def _tokenize(record: Submit, text: str) -> list[ToProxy]:
        if record.kind is RequestKind.DETOKENIZE:
            ids = record.prompt_ids[0]
            if any(i > 255 for i in ids):
                return [Error(record.rid, "tokens holds token ids outside the vocabulary",
                              param="tokens")]
            delta = Delta(record.rid, 0, bytes(ids).decode(errors="replace"), [])
        else:
            ids = list(text.encode())
            delta = Delta(record.rid, 0, "", ids)
        return [delta, Finish(record.rid, 0, FinishReason.STOP, Usage(len(ids), 0))]

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
