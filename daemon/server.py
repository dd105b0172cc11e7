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
no forward pass, and ResponseOps, whose replies can be large (a stored response, a page of
input items), wait and are answered one by one while the backlog is under the bound: however
many arrive at once, the backlog holds at most one reply beyond it.

ResponseOps wait in a queue fair between clients (daemon/responses/op_queue.py), and a tick
answers them only until it has spent OPS_TIME_S or OPS_BYTES on them (one at least), so that
however many a client sends, the forward pass comes round as often: a stream beside them keeps
its pace. An op whose proxy has stopped waiting (its ``deadline``) is answered unapplied.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from daemon.engine.core import Engine
from daemon.responses.op_queue import OpQueue
from daemon.responses.store import ResponseStore
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
from ipc.response_records import (
    ConversationItems,
    ResponseCancel,
    ResponseDelete,
    ResponseOp,
    ResponseReply,
)
from ipc.wire import ToProxy

log = logging.getLogger("tether.daemon")

Notify = Callable[[str], object]

STATS_INTERVAL_S = 0.1
IDLE_WAIT_S = 0.05
GRAMMAR_POLL_S = 0.001
WATCHDOG_INTERVAL_S = 1.0
STATUS_INTERVAL_S = 5.0
FLUSH_TIMEOUT_S = 1.0
# The store work of one tick: ops are answered until either is spent (the first whatever it
# costs; a store op's own size is bounded at the edge).
OPS_TIME_S = 0.05
OPS_BYTES = 8 << 20


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
        self._ops = OpQueue()
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
            if not ran and not self._ops_ready:
                # A grammar compiles on its own thread, in a millisecond or so: look again soon.
                self.pipes.wait_readable(GRAMMAR_POLL_S if self.engine.waiting_for_grammar
                                         else IDLE_WAIT_S)
        self._shutdown()
        return 0 if self.failure is None else 1

    def tick(self) -> bool:
        """One turn of the loop; returns whether a forward pass ran."""
        now = self.clock()
        self._drain_control(now)
        self._drain_requests()
        self._answer_ops()
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
                self._queue_op(item)
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
            self._queue_op(item)
        elif isinstance(item, Connected):
            # The sessions of older connections belong to clients their proxy already failed;
            # so do the ops still waiting for an answer.
            self._ops.clear()
            self._out += self.engine.abort_epoch_older_than(item.epoch, AbortCause.PROXY_LOST)
        elif isinstance(item, Goodbye):
            self._out += self.engine.abort_epoch_older_than(item.epoch + 1, AbortCause.PROXY_LOST)
        elif isinstance(item, Lost):
            log.warning("proxy lost (%s); aborting its requests", item.loss.detail)
            self._ops.clear()
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

    # --- ResponseOps: answered as fast as the proxy reads the replies -------------------------

    def _queue_op(self, op: ResponseOp) -> None:
        refused = self._ops.put(op)
        if refused is not None:
            self._out.append(refused)

    @property
    def _ops_ready(self) -> bool:
        """Ops wait that this tick's budget left, and the proxy is reading: go round at once."""
        return bool(len(self._ops)) and not self.pipes.backlogged

    def _answer_ops(self) -> None:
        """Answers waiting ops, fairly between clients, until the tick's budget is spent."""
        until, spent = self.clock() + OPS_TIME_S, 0
        while not self.pipes.backlogged and (op := self._ops.take()) is not None:
            reply = self._response_op(op)
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
            spent += _op_bytes(op, reply)
            if self.clock() >= until or spent >= OPS_BYTES:
                return

    def _response_op(self, op: ResponseOp) -> ResponseReply:
        if op.deadline is not None and self.clock() >= op.deadline:
            return ResponseReply(op.op_id, 503, message="the operation waited in the daemon's "
                                 "queue until its proxy stopped waiting; it was not applied: "
                                 "retry")
        running = self.engine.is_running(op.subject)
        responses = self.engine.responses
        reply = (responses.handle_op(op, running) if responses is not None else
                 ResponseReply(op.op_id, 500, message="the Responses API needs the response store"))
        # A 200 to either obliges us to stop the session: a live background response is
        # cancelled before it is deleted (a live foreground one is refused, never deleted).
        ends = isinstance(op.request, ResponseCancel | ResponseDelete)
        if ends and reply.status == 200 and running:
            self._out += self.engine.abort(op.subject, AbortCause.CANCEL)
        return reply

    # --- shutdown -------------------------------------------------------------------------------

    def _done(self) -> bool:
        if self.failure is not None:
            return True
        if self.stop_deadline is None:
            return False
        idle = not (self.engine.has_work or self.engine.waiting_for_grammar)
        return idle or self.clock() >= self.stop_deadline

    def _shutdown(self) -> None:
        self.notify("STOPPING=1")
        if self.failure is not None:
            log.error("stopping: %s", self.failure)
            self._out += self.engine.fail_all(self.failure)
        self._out += self.engine.abort_all(AbortCause.SHUTDOWN)
        self._flush_records(self.clock(), force=True)
        if self.failure is None and (goodbye := self.connection.goodbye()) is not None:
            self.pipes.send([goodbye])  # last of all: the proxy takes our EOF for a stop
        deadline = self.clock() + FLUSH_TIMEOUT_S
        while self.pipes.proxy_connected and self.pipes.tokens_backlog \
                and self.clock() < deadline:
            self.pipes.wait_readable(0.01)
        log.info("stopped")


def _op_bytes(op: ResponseOp, reply: ResponseReply) -> int:
    """About what an op moved: the items it brought and the ones (or the text) its reply
    carries."""
    items = getattr(op.request, "items", None)
    stored = reply.response
    return (2 * len(items.items) if isinstance(items, ConversationItems) else 0) \
        + len(reply.input_items or "") + sum(
            len(r.output_text or "") + len(r.instructions or "") + len(r.echo)
            for r in [*reply.responses, *([stored] if stored is not None else [])])
