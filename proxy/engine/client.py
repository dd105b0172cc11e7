"""The proxy's side of the daemon: sessions keyed by engine id over the three FIFOs.

The connection (ipc/connection/proxy.py) says whether the daemon is up, why it is not, and what
model it serves, and stamps its epoch on what is written. It delivers every record from the
tokens pipe to `_on_record` on the event loop; each record is routed by rid to its session's
buffer (proxy/engine/session.py) and wakes the one coroutine reading it. A sweep twice a second ends
what would otherwise wait forever: a request the daemon has not acknowledged within the request
timeout (504, Abort with cause ``timeout``) and a session whose client has taken nothing for the
stall timeout (same cause). Flow control: once a session holds ``max_buffered`` weighted tokens
its client has not read, the daemon is told to Pause it, and to Resume once the client has read
half of them (the session itself notices, through the `Flow` it was opened with).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from pathlib import Path

from ipc.framing import MAX_FRAME_BYTES, FrameTooLarge
from ipc.pipes import DaemonUnavailable, Loss, LossReason, ProxyConnection
from ipc.records import (
    Abort,
    AbortCause,
    Admitted,
    Delta,
    Error,
    Finish,
    GenerationDefaults,
    Submit,
    ToolCallFormat,
)
from ipc.response_records import REQUESTS_PIPE, ResponseOp, ResponseReply, StoreRequest
from ipc.stats import Stats
from ipc.wire import ToProxy
from proxy.engine.batching import Batch
from proxy.engine.session import Flow, Phase, Session
from proxy.http.errors import ApiError
from proxy.http.tenancy import ANYONE, Who

log = logging.getLogger("tether.proxy")

StatsListener = Callable[[Stats], None]

SWEEP_S = 0.5
# How long past an op's deadline its answer is waited for: the daemon answers an op it did not
# get to by then at once, unapplied; only one already under way (a store waiting on a lock:
# SQLite's busy timeout is 5 s) can take longer.
REPLY_GRACE_S = 10.0


def unavailable(reason: str) -> ApiError:
    return ApiError(503, f"the engine is unavailable: {reason}", code="engine_unavailable")


def too_large(exc: FrameTooLarge) -> ApiError:
    """A request that, as the engine would be sent it (its item references resolved, its text
    escaped), outgrows the pipe's frame."""
    return ApiError(413, f"the request is too large for the engine as sent: {exc} (the limit "
                    f"of one request as the daemon is sent it, {MAX_FRAME_BYTES} bytes)",
                    code="request_too_large")


class EngineClient:
    def __init__(self, runtime_dir: Path, max_waiting: int, request_timeout: float = 60.0,
                 stall_timeout: float = 60.0, max_buffered: int = 1024,
                 merge_tokens: int = 1) -> None:
        self.max_waiting = max_waiting
        self.request_timeout = request_timeout
        self.stall_timeout = stall_timeout
        # The last Stats any daemon sent, kept while it is away: its counters keep their values.
        self.last_stats: Stats | None = None
        self.stats_listeners: list[StatsListener] = []
        self._sessions: dict[str, Session] = {}
        self._num_unstarted = 0
        self._ops: dict[str, asyncio.Future[ResponseReply]] = {}
        self._ready: list[Session] = []  # sessions given records by the read being delivered
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connection = ProxyConnection(runtime_dir, self._on_record, self._on_state,
                                           self._on_delivered)
        self._flow = Flow(max_buffered, merge_tokens, self._connection.control)
        self._sweeper: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()  # set while up: what readiness waits for

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._connection.start()
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="tether-sessions-sweep")

    async def close(self) -> None:
        self.abort_all(AbortCause.SHUTDOWN)
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self._connection.close()

    def abort_all(self, cause: AbortCause) -> int:
        """Aborts every open session but background ones (the daemon goes on with those, and a
        new proxy serves them from the store); their readers get a 503. Returns how many."""
        count = 0
        for session in list(self._sessions.values()):
            if session.detached:
                continue
            if session.needs_abort():
                self._end(session, cause)
                count += 1
            session.fail(unavailable("the server is shutting down"))
        return count

    # --- state ----------------------------------------------------------------------------------

    @property
    def up(self) -> bool:
        return self._connection.up

    @property
    def down_reason(self) -> str:
        return self._connection.down_reason

    async def wait_up(self) -> None:
        """Until the daemon has welcomed us: a request sent then is served."""
        await self._connected.wait()

    # What the daemon serves, as its last Welcome said (None until the first).

    @property
    def model(self) -> str | None:
        welcome = self._connection.welcome
        return None if welcome is None else welcome.model

    @property
    def max_model_len(self) -> int | None:
        welcome = self._connection.welcome
        return None if welcome is None else welcome.max_model_len

    @property
    def tensor_parallel_size(self) -> int | None:
        welcome = self._connection.welcome
        return None if welcome is None else welcome.tensor_parallel_size

    @property
    def generation_defaults(self) -> GenerationDefaults:
        """The model's sampling defaults for requests that omit them (none until a Welcome)."""
        welcome = self._connection.welcome
        return GenerationDefaults() if welcome is None else welcome.generation_defaults

    @property
    def tool_call_format(self) -> ToolCallFormat:
        """How the model writes tool calls (Hermes' until a Welcome says)."""
        welcome = self._connection.welcome
        return ToolCallFormat.HERMES if welcome is None else welcome.tool_call_format

    @property
    def single_tool_call(self) -> bool:
        """Whether the chat template takes one tool call a turn (no until a Welcome says)."""
        welcome = self._connection.welcome
        return welcome is not None and welcome.single_tool_call

    @property
    def aborts_sent(self) -> dict[AbortCause, int]:
        """Abort records actually written to the daemon, by cause."""
        return self._connection.aborts_written

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
        return self._connection.bad_records

    # --- sessions -------------------------------------------------------------------------------

    def open_session(self, submit: Submit, detached: bool = False) -> Session:
        """Registers a session and queues its Submit (a daemon that is away fails it at once).
        Whoever opens a session closes it, however its request ends."""
        session = self._open(submit, detached)
        try:
            session.frame = self._connection.queue_submit(submit)
        except DaemonUnavailable as exc:
            session.fail(unavailable(str(exc) or self.down_reason))
        except FrameTooLarge as exc:
            session.fail(too_large(exc))
        return session

    def close_session(self, session: Session, abort: bool = True) -> None:
        """Forgets the session; unless it ended, stops the daemon's work on it right now (Abort
        written before anything else can run on the loop, or the Submit taken back if none of
        it went out)."""
        self._close(session)
        session.sink = None
        if abort and session.needs_abort():
            self._end(session, AbortCause.CLIENT_DISCONNECT, time.monotonic())

    async def generate(self, submit: Submit,
                       abort_on_exit: bool = True) -> AsyncGenerator[Batch, None]:
        """This rid's Delta and Finish records in batches (`Session.next_batch`) until every
        sequence has finished. Leaving early (close, cancellation, an exception in the consumer)
        writes the Abort in the ``finally`` (`close_session`) unless ``abort_on_exit`` is false."""
        session = self.open_session(submit, detached=not abort_on_exit)
        try:
            while (batch := await session.next_batch()) is not None:
                yield batch
        finally:
            self.close_session(session, abort_on_exit)

    def abort(self, rid: str, cause: AbortCause, t_disconnect: float | None = None) -> None:
        """Writes one Abort record now; idempotent on the daemon side, a no-op if it is down."""
        if not self._connection.control(Abort(rid, cause, t_disconnect=t_disconnect)):
            log.debug("abort of %s not written: the daemon is down", rid)

    def _end(self, session: Session, cause: AbortCause, t_disconnect: float | None = None) -> None:
        """Stop the daemon's work on a session: take its Submit back if none of it went out,
        else write the Abort."""
        if session.frame is None or not self._connection.withdraw(session.frame):
            self.abort(session.rid, cause, t_disconnect)

    async def response_op(self, request: StoreRequest, timeout: float = 5.0,  # noqa: ASYNC109
                          who: Who = ANYONE) -> ResponseReply:
        """One ResponseOp and its reply. A conversation's and a request's item references
        travel on the requests pipe, as big as a Submit; the others on control.

        The daemon applies the op only within ``timeout``; past it, it answers without
        applying it. So this waits for that answer rather than give up at ``timeout``: a 503
        that says "not applied" is true, and a client's retry stores once. Only a daemon that
        says nothing for REPLY_GRACE_S longer (lost, or stuck in one operation) is answered
        with a 503 that cannot say."""
        if not self.up:
            raise unavailable(self.down_reason)
        op_id = uuid.uuid4().hex
        future: asyncio.Future[ResponseReply] = asyncio.get_running_loop().create_future()
        self._ops[op_id] = future
        record = ResponseOp(op_id, request, tenant=who.tenant, client=who.client,
                            deadline=time.monotonic() + timeout)
        try:
            if isinstance(request, REQUESTS_PIPE):
                try:
                    self._connection.queue_submit(record)
                except DaemonUnavailable:
                    raise unavailable(self.down_reason) from None
                except FrameTooLarge as exc:
                    raise too_large(exc) from None
            elif not self._connection.control(record):
                raise unavailable(self.down_reason)
            return await asyncio.wait_for(future, timeout + REPLY_GRACE_S)
        except TimeoutError:
            raise unavailable(f"no answer from the daemon within {timeout + REPLY_GRACE_S:g} s; "
                              "the operation may or may not have been applied") from None
        finally:
            self._ops.pop(op_id, None)

    def _open(self, submit: Submit, detached: bool) -> Session:
        if not self.up:
            raise unavailable(self.down_reason)
        if submit.rid in self._sessions:
            raise ApiError(400, f"request id {submit.rid!r} is already in flight",
                           param="X-Request-Id", code="duplicate_request_id")
        if self._num_unstarted >= self.max_waiting:
            raise ApiError(429, f"too many requests waiting (limit {self.max_waiting})",
                           code="too_many_waiting", headers={"Retry-After": "1"})
        session = Session(submit, self._flow, detached, time.monotonic() + self.request_timeout)
        self._sessions[submit.rid] = session
        self._num_unstarted += 1
        return session

    def _close(self, session: Session) -> None:
        if self._sessions.get(session.rid) is session:
            del self._sessions[session.rid]
            if session.phase < Phase.STARTED:
                self._num_unstarted -= 1

    # --- callbacks from the connection (on the event loop) --------------------------------------

    def _on_record(self, record: ToProxy) -> None:
        if isinstance(record, Delta | Finish | Error) and record.rid is not None:
            session = self._sessions.get(record.rid)
            if session is None:
                return  # late records of a session that already ended (aborted, failed)
            if session.started():
                self._num_unstarted -= 1
            if session.push(record):
                self._ready.append(session)
        elif isinstance(record, Admitted):
            session = self._sessions.get(record.rid)
            if session is not None:
                session.admitted()
        elif isinstance(record, Stats):
            self.last_stats = record
            for listener in self.stats_listeners:
                listener(record)
        elif isinstance(record, ResponseReply):
            future = self._ops.get(record.op_id)
            if future is not None and not future.done():
                future.set_result(record)
        elif isinstance(record, Error):
            log.error("daemon error: %s", record.message)

    def _on_delivered(self) -> None:
        """A read's records are routed: wake each reader they concern, once."""
        ready, self._ready = self._ready, []
        for session in ready:
            try:
                session.wake()
            except Exception as exc:  # a broken sink must not cost the other readers theirs
                log.exception("waking the reader of %s failed", session.rid)
                session.sink = None
                session.fail(ApiError(500, f"internal error: {exc}", code="internal_error"))

    def _on_state(self, loss: Loss | None) -> None:
        if loss is None:
            self._connected.set()
            welcome = self._connection.welcome
            assert welcome is not None  # up means welcomed
            log.info("daemon %d serves %s (max_model_len %d, tensor parallel %d)", welcome.pid,
                     welcome.model, welcome.max_model_len, welcome.tensor_parallel_size)
            return
        self._connected.clear()
        # The next connection gets a new epoch: a daemon that only stalled then evicts the
        # sessions we just failed here, and refuses their Submits still in the pipe.
        error = unavailable(loss.detail)
        for session in list(self._sessions.values()):
            session.lose(error)
        for future in self._ops.values():
            if not future.done():
                future.set_exception(error)
        if loss.reason is LossReason.STOPPED:
            log.info("%s; answering 503 until a daemon connects", loss.detail)
        else:
            log.warning("daemon lost: %s", loss.detail)


    # --- what would otherwise wait forever ------------------------------------------------------

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                self._sweep(time.monotonic())
            except Exception:  # the sweep must outlive any surprise, or timeouts stop
                log.exception("session sweep failed")

    def _sweep(self, now: float) -> None:
        for session in list(self._sessions.values()):
            if session.failure is not None:
                continue
            if session.phase is Phase.QUEUED and now >= session.deadline:
                self._end(session, AbortCause.TIMEOUT)
                session.fail(ApiError(
                    504, f"the engine did not take the request within "
                    f"{self.request_timeout:g} s", code="timeout"))
            elif session.is_stuck(now, self.stall_timeout):
                self._stall(session)
            elif session.pause_sent != session.paused:
                self._flow.send(session, session.paused)

    def _stall(self, session: Session) -> None:
        """The client took nothing for the stall timeout: stop the engine, drop what is held."""
        log.info("request %s stalled: its client read nothing for %g s", session.rid,
                 self.stall_timeout)
        if session.needs_abort():
            self.abort(session.rid, AbortCause.TIMEOUT)
        session.records = []
        session.fail(ApiError(504, f"the client read nothing for {self.stall_timeout:g} s; "
                              "the request was aborted", code="timeout"))
