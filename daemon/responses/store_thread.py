"""The responses room's own thread: every store transaction of a Responses session and every
ResponseOp runs here, on the store's connection, never on the tick.

The tick hands it work and never waits for it. The engine's jobs (a turn to load, a first tick,
an end) run in the order given; the proxy's ResponseOps wait in the queue of op_queue.py, fair
between clients, and one whose proxy has stopped waiting (its ``deadline``) is answered without
being applied. Jobs and ops take turns in the order they came: an op waits for the jobs given
before it, so it sees everything the tick told the store until then (a GET after a drop finds no
placeholder), and for none given after it, so a stream of stored turns never starves it. The
answers wait in two queues that the tick reads between forward passes: the engine's (a turn
loaded or refused, a result stored) and the replies, which the tick sends only as fast as the
proxy reads them. The thread runs ahead of that by at most ``reply_bytes`` of replies: past it,
it answers no op until the tick has sent some, so a flood's replies wait as ops, bounded by the
queue, not as megabytes in memory. The engine's jobs never wait for that.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from daemon.responses.events import Result
from daemon.responses.keeper import Keeper
from daemon.responses.op_queue import OpQueue
from ipc.response_records import ConversationItems, ResponseOp, ResponseReply

log = logging.getLogger("tether.store")

# Replies answered and not yet taken by the tick, at most (the first whatever its size).
REPLY_BYTES = 8 << 20

Job = Callable[[Keeper], Result | None]


class StoreThread:
    def __init__(self, keeper: Keeper, clock: Callable[[], float] = time.monotonic,
                 reply_bytes: int = REPLY_BYTES) -> None:
        self.keeper = keeper
        self.clock = clock
        self.reply_bytes = reply_bytes
        self._cond = threading.Condition()
        # Jobs and ops are numbered as they come: an op goes before the jobs that came after it.
        self._arrivals = itertools.count()
        self._jobs: deque[tuple[int, Job]] = deque()
        self._ops = OpQueue()
        self._op_arrivals: dict[str, int] = {}
        self._results: deque[Result] = deque()
        self._replies: deque[tuple[ResponseOp, ResponseReply, int]] = deque()
        self._unsent = 0  # bytes of the replies waiting for the tick
        self._working = False
        self._closing = False
        self._thread: threading.Thread | None = None

    # --- the tick's side: none of it waits on the store ----------------------------------------

    def do(self, job: Job) -> None:
        """Runs ``job`` on the thread, after the jobs and ops given before it."""
        with self._cond:
            self._jobs.append((next(self._arrivals), job))
            self._wake()

    def put_op(self, op: ResponseOp) -> ResponseReply | None:
        """Queues the op; or, past the queue's bounds, the 503 that answers it now."""
        with self._cond:
            refused = self._ops.put(op)
            if refused is None:
                self._op_arrivals[op.op_id] = next(self._arrivals)
                self._wake()
            return refused

    def clear_ops(self) -> None:
        """Drops the ops still waiting (their proxy has failed them)."""
        with self._cond:
            self._ops.clear()
            self._op_arrivals.clear()

    def take_results(self) -> list[Result]:
        if not self._results:  # most ticks: no lock taken (what comes meanwhile, next tick)
            return []
        with self._cond:
            out = list(self._results)
            self._results.clear()
            return out

    def take_reply(self) -> tuple[ResponseOp, ResponseReply] | None:
        """The oldest reply not sent yet, in the order the ops were answered."""
        if not self._replies:
            return None
        with self._cond:
            if not self._replies:
                return None
            op, reply, size = self._replies.popleft()
            self._unsent -= size
            self._cond.notify()
            return op, reply

    @property
    def has_reply(self) -> bool:
        return bool(self._replies)

    @property
    def busy(self) -> bool:
        """Whether it has work in hand or answers the tick has not taken."""
        with self._cond:
            return bool(self._jobs or len(self._ops) or self._working or self._results
                        or self._replies)

    def close(self, timeout: float) -> bool:
        """Finishes the jobs given so far (the ends of the sessions the daemon stopped), drops
        the ops, and stops; False if the jobs took longer than ``timeout``."""
        with self._cond:
            self._closing = True
            self._ops.clear()
            self._op_arrivals.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def _wake(self) -> None:
        if self._thread is None and not self._closing:
            self._thread = threading.Thread(target=self._run, name="tether-store", daemon=True)
            self._thread.start()
        self._cond.notify()

    # --- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                work = self._next()
                if work is None:
                    return
                self._working = True
            try:
                if isinstance(work, ResponseOp):
                    reply = self._answer(work)
                    with self._cond:
                        size = reply_bytes(work, reply)
                        self._replies.append((work, reply, size))
                        self._unsent += size
                else:
                    result = work(self.keeper)
                    if result is not None:
                        with self._cond:
                            self._results.append(result)
            except Exception:  # a bug in one job must not stop the others
                log.exception("the store thread's work failed")
            finally:
                with self._cond:
                    self._working = False

    def _next(self) -> Job | ResponseOp | None:
        """The next work, under the lock: the op whose turn it is if it came before the oldest
        job (and the replies waiting for the tick are under their bound), else that job; None
        once closing and the jobs are done."""
        while True:
            op = self._ops.peek() if self._unsent < self.reply_bytes else None
            if op is not None and (not self._jobs
                                   or self._op_arrivals[op.op_id] < self._jobs[0][0]):
                self._ops.take()
                del self._op_arrivals[op.op_id]
                return op
            if self._jobs:
                return self._jobs.popleft()[1]
            if self._closing:
                return None
            self._cond.wait()

    def _answer(self, op: ResponseOp) -> ResponseReply:
        if op.deadline is not None and self.clock() >= op.deadline:
            return ResponseReply(op.op_id, 503, message="the operation waited in the daemon's "
                                 "queue until its proxy stopped waiting; it was not applied: "
                                 "retry")
        return self.keeper.answer(op)


def reply_bytes(op: ResponseOp, reply: ResponseReply) -> int:
    """About what an op moves: the items it brought and the ones (or the text) its reply
    carries."""
    items = getattr(op.request, "items", None)
    stored = reply.response
    return (2 * len(items.items) if isinstance(items, ConversationItems) else 0) \
        + len(reply.input_items or "") + sum(
            len(r.output_text or "") + len(r.instructions or "") + len(r.echo)
            for r in [*reply.responses, *([stored] if stored is not None else [])])
