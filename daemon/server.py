"""The daemon's tick loop around one engine and one set of pipes.

One thread does everything, in this order each tick: control records (aborts first, so an abort
read now is applied before the next forward pass) -> new requests -> one engine step -> send
records -> Stats. When there is no work it sleeps in `wait_readable`. (The pipes' keepalive
thread only speaks for it while a forward pass runs.)

The connection (ipc/connection/daemon.py) answers the proxy's Hello and assigns each connection
its epoch; what it reads comes here as work and events. A new connection ends the sessions of
older ones, a Goodbye or a lost proxy those of the current one, and Submits of any epoch but the
current one (still in the pipe from an earlier connection, or read after the proxy was lost or
said Goodbye) end at once as aborted with cause ``proxy_lost``.

The proxy is never dropped for reading slowly, only for not reading (ipc/daemon_side.py); what
waits for it is bounded here instead. While the tokens backlog is over its bound the loop runs
no forward pass, and the replies to ResponseOps, which can be large (a stored response, a page
of input items), wait and go out one by one while the backlog is under the bound: however many
come at once, the backlog holds at most one reply beyond it.

The Responses store is never touched here: its transactions run on the responses room's own
thread (daemon/responses/store_thread.py). The tick hands it the ResponseOps (queued there fairly
between clients, answered "not applied" once their proxy stopped waiting) and sends its replies,
in order with the aborts that a cancel or a delete obliges, at most OPS_BYTES of them a tick so
that the forward pass comes round as often however many a client asks for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from daemon.engine.core import Engine
from daemon.responses.store import ResponseStore
from daemon.responses.store_thread import reply_bytes
from ipc.framing import FrameTooLarge
from ipc.pipes import (
    Connected,
    ControlItem,
    DaemonConnection,
    DaemonPipes,
    EpochCounter,
    Lost,
    ModelInfo,
    Stale,
)
from ipc.records import (
    Abort,
    AbortCause,
    Error,
    GenerationDefaults,
    Goodbye,
    Pause,
    Resume,
    Submit,
    ToolCallFormat,
    Welcome,
)
from ipc.response_records import ResponseCancel, ResponseDelete, ResponseOp, ResponseReply
from ipc.wire import ToProxy

log = logging.getLogger("tether.daemon")

Notify = Callable[[str], object]

STATS_INTERVAL_S = 0.1
IDLE_WAIT_S = 0.05
# A grammar compiles, or the store thread works, on threads of their own: while they do, the
# loop looks again this soon.
WORK_POLL_S = 0.001
WATCHDOG_INTERVAL_S = 1.0
STATUS_INTERVAL_S = 5.0
FLUSH_TIMEOUT_S = 1.0
# The replies one tick sends (the first whatever its size; a store op's own is bounded at the
# edge).
OPS_BYTES = 8 << 20
# How long the store thread has, at shutdown, to record the ends of the sessions stopped.
STORE_CLOSE_S = 5.0


class DaemonServer:
    """The tick loop around one engine and one set of pipes; `serve` returns the exit code."""

    def __init__(self, engine: Engine, pipes: DaemonPipes, store: ResponseStore,
                 drain_timeout_s: float, notify: Notify | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 epochs: EpochCounter | None = None, tensor_parallel_size: int = 1,
                 tool_call_format: ToolCallFormat = ToolCallFormat.HERMES,
                 single_tool_call: bool = False,
                 generation_defaults: GenerationDefaults | None = None) -> None:
        self.engine = engine
        self.pipes = pipes
        self.store = store
        self.drain_timeout_s = drain_timeout_s
        self.notify = notify or (lambda _msg: None)
        self.clock = clock
        self.connection = DaemonConnection(
            pipes, ModelInfo(engine.model_name, engine.max_model_len, tensor_parallel_size,
                             tool_call_format, single_tool_call,
                             generation_defaults or GenerationDefaults()),
            epochs)
        self.stop_deadline: float | None = None
        # Set (from any thread) when the daemon cannot go on, e.g. a tensor-parallel rank died.
        self.failure: str | None = None
        self._out: list[ToProxy] = []
        self._last_stats = 0.0
        self._last_sessions: tuple[int, int, int] | None = None
        self._last_watchdog = 0.0
        self._last_status = 0.0

    def request_stop(self, force: bool = False) -> None:
        """First call: stop admitting and drain; a forced (second) call aborts what is left."""
        now = self.clock()
        if self.stop_deadline is None:
            log.info("stopping; draining for up to %.1f s", self.drain_timeout_s)
            self.stop_deadline = now + self.drain_timeout_s
        elif force:
            self.stop_deadline = now

    def fail(self, reason: str) -> None:
        """The daemon cannot go on: end every session with an error and exit non-zero. Safe to
        call from another thread; the loop sees it within IDLE_WAIT_S."""
        if self.failure is None:
            self.failure = reason

    def serve(self) -> int:
        self.notify("READY=1")
        while not self._done():
            ran = self.tick()
            if not ran and not self._replies_ready:
                self.pipes.wait_readable(WORK_POLL_S if self._waiting_for_threads
                                         else IDLE_WAIT_S)
        self._shutdown()
        return 0 if self.failure is None else 1

    def tick(self) -> bool:
        """One turn of the loop; returns whether a forward pass ran."""
        now = self.clock()
        self._drain_control(now)
        self._drain_requests()
        self._out += self.engine.from_store()
        self._send_replies()
        self._out += self.engine.admit_guided()
        if self._out and self.engine.has_work:
            # Admissions and evictions go out before a forward pass that may take seconds.
            out, self._out = self._out, []
            self.pipes.send(out)
        ran = self._step()
        self._flush_records(now)
        self._tell_systemd(now)
        return ran

    # --- phases ---------------------------------------------------------------------------------

    def _drain_control(self, now: float) -> None:
        for item in self.connection.read_control():
            self._control(item, now)
        # Cancels that reached another replica for a response this one runs (no I/O here: the
        # store's watcher thread fetched them).
        responses = self.engine.responses
        for rid in responses.take_cancels() if responses is not None else ():
            self._out += self.engine.abort(rid, AbortCause.CANCEL, t_read=now)

    def _drain_requests(self) -> None:
        for item in self.connection.read_requests():
            if isinstance(item, Stale):
                self._out += self.engine.refuse(item.submit, AbortCause.PROXY_LOST)
            elif isinstance(item, ResponseOp):  # a conversation's: answered as any other op
                self._put_op(item)
            else:
                self._submit(item)

    def _step(self) -> bool:
        if not self.engine.has_work or self.pipes.backlogged:
            return False  # backlogged: the proxy reads more slowly than we write; wait for it
        try:
            self._out += self.engine.step()
        except Exception as e:  # a failed forward pass must not take the daemon down
            log.exception("engine step failed; failing every running request")
            self._out += self.engine.fail_all(f"internal error: {type(e).__name__}: {e}")
        return True

    def _flush_records(self, now: float, force: bool = False) -> None:
        # Stats go out when a request came or went (so /metrics shows an eviction's effect in
        # the tick that applied it) and every 100 ms otherwise, not every tick: at hundreds of
        # ticks a second they would cost the proxy more than the tokens do.
        sessions = (len(self.engine.sessions), len(self.engine.scheduler.running),
                    sum(self.engine.figures.finished.values()))
        if force or sessions != self._last_sessions or now - self._last_stats >= STATS_INTERVAL_S:
            self._last_sessions = sessions
            stats = self.engine.stats()
            stats.bad_records = dict(self.pipes.bad_records)
            self._out.append(stats)
            self._last_stats = now
        if self._out:
            out, self._out = self._out, []
            self.pipes.send(out)

    def _tell_systemd(self, now: float) -> None:
        if now - self._last_watchdog >= WATCHDOG_INTERVAL_S:
            self.notify("WATCHDOG=1")
            self._last_watchdog = now
        if now - self._last_status >= STATUS_INTERVAL_S:
            sched = self.engine.scheduler
            bm = self.engine.block_manager
            self.notify(f"STATUS=running {len(sched.running)}, waiting {len(sched.waiting)}, "
                        f"KV blocks {bm.num_used}/{bm.num_total}")
            self._last_status = now

    # --- records --------------------------------------------------------------------------------

    def _control(self, item: ControlItem, now: float) -> None:
        if isinstance(item, Abort):
            self._out += self.engine.abort(item.rid, item.cause, item.t_disconnect, t_read=now)
        elif isinstance(item, Pause | Resume):
            self.engine.set_paused(item.rid, isinstance(item, Pause))
        elif isinstance(item, ResponseOp):
            self._put_op(item)
        elif isinstance(item, Connected):
            # The sessions of older connections belong to clients their proxy already failed;
            # so do the ops still waiting for an answer.
            self._clear_ops()
            self._out += self.engine.abort_epoch_older_than(item.epoch, AbortCause.PROXY_LOST)
        elif isinstance(item, Goodbye):
            self._out += self.engine.abort_epoch_older_than(item.epoch + 1, AbortCause.PROXY_LOST)
        elif isinstance(item, Lost):
            log.warning("proxy lost (%s); aborting its requests", item.loss.detail)
            self._clear_ops()
            self._out += self.engine.abort_all(AbortCause.PROXY_LOST)
        elif isinstance(item, Welcome | Error):
            self._out.append(item)  # the connection's answers go out in order with ours

    def _submit(self, rec: Submit) -> None:
        if self.stop_deadline is not None:
            self._out.append(Error(rec.rid, "the server is shutting down", status=503))
            return
        try:
            self._out += self.engine.submit(rec)
        except Exception as e:  # one bad request (or a store failure) must not end the daemon
            log.exception("admitting %s failed", rec.rid)
            self._out.append(Error(rec.rid, f"internal error: {type(e).__name__}: {e}",
                                   status=500, code="internal_error"))

    # --- ResponseOps: answered on the store thread, sent as fast as the proxy reads them ---------

    def _put_op(self, op: ResponseOp) -> None:
        responses = self.engine.responses
        refused = (responses.put_op(op) if responses is not None else
                   ResponseReply(op.op_id, 500, message="the Responses API needs the response "
                                 "store"))
        if refused is not None:
            self._out.append(refused)

    def _clear_ops(self) -> None:
        if self.engine.responses is not None:
            self.engine.responses.clear_ops()

    @property
    def _replies_ready(self) -> bool:
        """Replies wait that this tick's budget left, and the proxy is reading: go round at
        once."""
        responses = self.engine.responses
        return responses is not None and responses.has_reply and not self.pipes.backlogged

    @property
    def _waiting_for_threads(self) -> bool:
        responses = self.engine.responses
        return self.engine.waiting_for_grammar or (responses is not None and responses.busy)

    def _send_replies(self) -> None:
        """Sends the store thread's replies in order until the tick's budget is spent; a 200 to
        a cancel or a delete first stops the session, if it still runs here (a live background
        response is cancelled before it is deleted; a live foreground one is never deleted)."""
        responses = self.engine.responses
        spent = 0
        while responses is not None and not self.pipes.backlogged \
                and (answered := responses.take_reply()) is not None:
            op, reply = answered
            if isinstance(op.request, ResponseCancel | ResponseDelete) and reply.status == 200 \
                    and self.engine.is_running(op.request.response_id):
                self._out += self.engine.abort(op.request.response_id, AbortCause.CANCEL)
            out, self._out = self._out, []
            self.pipes.send(out)  # in order: what came before, and a cancel's aborts
            try:
                self.pipes.send([reply])
            except FrameTooLarge as exc:  # only that request's error
                log.warning("the reply to %s %s does not fit a frame: %s", op.kind, op.subject,
                            exc)
                self.pipes.send([ResponseReply(op.op_id, 413, message=f"the answer is too "
                                               f"large for the daemon's pipe ({exc}): ask for "
                                               "less at once")])
            spent += reply_bytes(op, reply)
            if spent >= OPS_BYTES:
                return

    # --- shutdown -------------------------------------------------------------------------------

    def _done(self) -> bool:
        if self.failure is not None:
            return True
        if self.stop_deadline is None:
            return False
        idle = not (self.engine.has_work or self.engine.waiting_for_grammar
                    or self.engine.waiting_for_store)
        return idle or self.clock() >= self.stop_deadline

    def _shutdown(self) -> None:
        self.notify("STOPPING=1")
        if self.failure is not None:
            log.error("stopping: %s", self.failure)
            self._out += self.engine.fail_all(self.failure)
        self._out += self.engine.abort_all(AbortCause.SHUTDOWN)
        if self.engine.stored is not None:  # the ends it was just told, and results held
            self._out += self.engine.stored.close(STORE_CLOSE_S)
        self._flush_records(self.clock(), force=True)
        if self.failure is None and (goodbye := self.connection.goodbye()) is not None:
            self.pipes.send([goodbye])  # last of all: the proxy takes our EOF for a stop
        deadline = self.clock() + FLUSH_TIMEOUT_S
        while self.pipes.proxy_connected and self.pipes.tokens_backlog \
                and self.clock() < deadline:
            self.pipes.wait_readable(0.01)
        log.info("stopped")
