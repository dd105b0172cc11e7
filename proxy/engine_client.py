"""The proxy's side of the daemon: sessions keyed by request id over the three FIFOs.

`ProxyPipes` delivers every record from the tokens pipe to `_on_record` on the event loop; each
record is routed by rid to its session's buffer and wakes the one coroutine reading it. A
session is a few slots, a deque and at most one future, so thousands of held streams stay cheap.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from pathlib import Path

from ipc.pipes import DaemonUnavailable, ProxyPipes
from ipc.records import (
    Abort,
    AbortCause,
    Delta,
    Error,
    Finish,
    FinishReason,
    RequestKind,
    ResponseOp,
    ResponseOpKind,
    ResponseReply,
    Stats,
    Submit,
    ToProxy,
    Welcome,
)
from proxy.errors import ApiError

log = logging.getLogger("tether.proxy")

StatsListener = Callable[[Stats], None]

_ENDED_BY_DAEMON = (FinishReason.ABORT, FinishReason.ERROR)


def num_sequences(submit: Submit) -> int:
    if submit.kind is RequestKind.COMPLETION:
        return len(submit.prompts) * submit.n
    return submit.n


def unavailable(reason: str) -> ApiError:
    return ApiError(503, f"the engine is unavailable: {reason}", code="engine_unavailable")


class _Session:
    __slots__ = ("complete", "detached", "failure", "finished", "records", "rejected", "rid",
                 "started", "unfinished", "waiter")

    def __init__(self, rid: str, sequences: int, detached: bool) -> None:
        self.rid = rid
        self.detached = detached  # a background response: the daemon runs it without a client
        # A list, not a deque: an empty deque is 760 bytes, and thousands of sessions wait
        # with nothing buffered. The reader takes the whole list at once.
        self.records: list[Delta | Finish | Error] = []
        self.waiter: asyncio.Future[None] | None = None
        self.finished = bytearray(sequences)  # 1 per index once its Finish arrived
        self.unfinished = sequences
        self.started = False  # the daemon has sent a record for it
        self.complete = False  # every sequence finished
        self.rejected = False  # the daemon answered with an Error record
        self.failure: ApiError | None = None  # daemon lost or proxy shutting down

    def push(self, record: Delta | Finish | Error) -> None:
        self.records.append(record)
        self._wake()

    def fail(self, exc: ApiError) -> None:
        if self.failure is None:
            self.failure = exc
            self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def needs_abort(self) -> bool:
        return not (self.complete or self.rejected or self.failure is not None)


class EngineClient:
    def __init__(self, runtime_dir: Path, max_waiting: int,
                 submit_timeout: float = 5.0) -> None:
        self.epoch = time.time_ns()
        self.max_waiting = max_waiting
        self.submit_timeout = submit_timeout
        self.model: str | None = None
        self.max_model_len: int | None = None
        self.last_stats: Stats | None = None
        self.down_reason = "the daemon has not connected yet"
        self.stats_listeners: list[StatsListener] = []
        self.aborts_sent: dict[AbortCause, int] = dict.fromkeys(AbortCause, 0)
        self._pipes_up = False
        self._welcomed = False
        self._sessions: dict[str, _Session] = {}
        self._num_unstarted = 0
        self._ops: dict[str, asyncio.Future[ResponseReply]] = {}
        self._pipes = ProxyPipes(runtime_dir, self.epoch, self._on_record, self._on_state)

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        await self._pipes.start()

    async def close(self) -> None:
        self.abort_all(AbortCause.SHUTDOWN)
        await self._pipes.close()

    def abort_all(self, cause: AbortCause) -> int:
        """Aborts every open session but background ones (the daemon goes on with those, and a
        new proxy serves them from the store); their readers get a 503. Returns how many."""
        count = 0
        for session in list(self._sessions.values()):
            if session.detached:
                continue
            if session.needs_abort():
                self.abort(session.rid, cause)
                count += 1
            session.fail(unavailable("the server is shutting down"))
        return count

    # --- state ----------------------------------------------------------------------------------

    @property
    def up(self) -> bool:
        return self._pipes_up and self._welcomed

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def num_attached(self) -> int:
        """Sessions a client waits on: what a graceful stop drains."""
        return sum(not s.detached for s in self._sessions.values())

    @property
    def num_waiting(self) -> int:
        """Sessions submitted that the daemon has not answered yet (queued or prefilling)."""
        return self._num_unstarted

    @property
    def bad_records(self) -> int:
        return self._pipes.bad_records

    # --- sessions -------------------------------------------------------------------------------

    async def generate(self, submit: Submit,
                       abort_on_exit: bool = True) -> AsyncGenerator[Delta | Finish, None]:
        """Yields this rid's Delta and Finish records until every sequence has finished.

        Leaving early (close, cancellation, an exception in the consumer) writes the Abort in
        the ``finally``, synchronously, before anything else can run on the loop.
        """
        session = self._open(submit, detached=not abort_on_exit)
        try:
            try:
                await self._pipes.submit(submit, timeout=self.submit_timeout)
            except DaemonUnavailable as exc:
                session.fail(unavailable(str(exc) or self.down_reason))
            while True:
                while session.records:
                    batch, session.records = session.records, []
                    for record in batch:
                        if isinstance(record, Error):
                            session.rejected = True
                            raise ApiError(record.status, record.message, record.param,
                                           record.code)
                        if isinstance(record, Finish):
                            session.complete = self._finish(session, record)
                            if record.reason in _ENDED_BY_DAEMON:
                                # The daemon evicts a session whole: nothing left to abort.
                                session.rejected = True
                        yield record
                        if session.complete:
                            return
                if session.failure is not None:
                    raise session.failure
                session.waiter = asyncio.get_running_loop().create_future()
                await session.waiter
                session.waiter = None
        finally:
            self._close(session)
            if abort_on_exit and session.needs_abort():
                self.abort(session.rid, AbortCause.CLIENT_DISCONNECT, time.monotonic())

    def abort(self, rid: str, cause: AbortCause, t_disconnect: float | None = None) -> None:
        """Writes one Abort record now; idempotent on the daemon side, a no-op if it is down."""
        self.aborts_sent[cause] += 1
        if not self._pipes.control(Abort(rid, cause, self.epoch, t_disconnect)):
            log.debug("abort of %s not written: the daemon is down", rid)

    async def response_op(self, op: ResponseOpKind, response_id: str,
                          timeout: float = 5.0) -> ResponseReply:  # noqa: ASYNC109
        if not self.up:
            raise unavailable(self.down_reason)
        op_id = uuid.uuid4().hex
        future: asyncio.Future[ResponseReply] = asyncio.get_running_loop().create_future()
        self._ops[op_id] = future
        try:
            if not self._pipes.control(ResponseOp(op_id, op, response_id, self.epoch)):
                raise unavailable(self.down_reason)
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise unavailable(f"no answer from the daemon within {timeout:g} s") from None
        finally:
            self._ops.pop(op_id, None)

    def _open(self, submit: Submit, detached: bool) -> _Session:
        if not self.up:
            raise unavailable(self.down_reason)
        if submit.rid in self._sessions:
            raise ApiError(400, f"request id {submit.rid!r} is already in flight",
                           param="X-Request-Id", code="duplicate_request_id")
        if self._num_unstarted >= self.max_waiting:
            raise ApiError(429, f"too many requests waiting (limit {self.max_waiting})",
                           code="too_many_waiting", headers={"Retry-After": "1"})
        session = _Session(submit.rid, num_sequences(submit), detached)
        self._sessions[submit.rid] = session
        self._num_unstarted += 1
        return session

    def _close(self, session: _Session) -> None:
        if self._sessions.get(session.rid) is session:
            del self._sessions[session.rid]
            if not session.started:
                self._num_unstarted -= 1

    @staticmethod
    def _finish(session: _Session, record: Finish) -> bool:
        if 0 <= record.index < len(session.finished) and not session.finished[record.index]:
            session.finished[record.index] = 1
            session.unfinished -= 1
        return session.unfinished == 0

    # --- callbacks from ProxyPipes (on the event loop) ------------------------------------------

    def _on_record(self, record: ToProxy) -> None:
        if isinstance(record, Delta | Finish | Error) and record.rid is not None:
            session = self._sessions.get(record.rid)
            if session is None:
                return  # late records of a session that already ended (aborted, failed)
            if not session.started:
                session.started = True
                self._num_unstarted -= 1
            session.push(record)
        elif isinstance(record, Stats):
            self.last_stats = record
            for listener in self.stats_listeners:
                listener(record)
        elif isinstance(record, ResponseReply):
            future = self._ops.get(record.op_id)
            if future is not None and not future.done():
                future.set_result(record)
        elif isinstance(record, Welcome):
            self._on_welcome(record)
        elif isinstance(record, Error):
            log.error("daemon error: %s", record.message)

    def _on_welcome(self, record: Welcome) -> None:
        if record.epoch != self.epoch:
            log.warning("ignoring a Welcome for epoch %d (ours is %d)", record.epoch, self.epoch)
            return
        self.model = record.model
        self.max_model_len = record.max_model_len
        self._welcomed = True
        log.info("daemon %d serves %s (max_model_len %d)", record.pid, record.model,
                 record.max_model_len)

    def _on_state(self, up: bool, reason: str) -> None:
        self._pipes_up = up
        if up:
            return
        self._welcomed = False
        # The next Hello carries a new epoch: a daemon that only stalled then evicts the sessions
        # we just failed here, instead of running them for nobody.
        self.epoch = self._pipes.epoch = time.time_ns()
        self.down_reason = reason or "the daemon went away"
        error = unavailable(self.down_reason)
        for session in self._sessions.values():
            session.fail(error)
        for future in self._ops.values():
            if not future.done():
                future.set_exception(error)
        log.warning("daemon lost: %s", self.down_reason)
