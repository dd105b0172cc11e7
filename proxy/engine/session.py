"""One request's state in the proxy, and the one owner of it: what the daemon has said of it
(its phase), the records its reader has not taken yet, how much of it the client has not read
(flow control), and its failure if the proxy gave up on it.

A session is a few slots, a list and at most one future, so thousands of held streams stay
cheap. "Held" records were pushed by the tokens reader and not yet handed on, which for a stream
means not yet taken by the socket; "units" weigh them by what they cost to keep (a token
counts once, plus once per log-probability alternative), and drive Pause and Resume: past the
high water mark the session asks its `Flow` to pause it, and to resume it once its client has
read half of that.

Its reader is woken once per read of the tokens pipe that brought it records (or when it
fails): either the coroutine waiting in `next_batch`, or a `sink` called right there, which
writes them to the client without a task switch (proxy/engine/token_stream.py).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable

from ipc.proxy_writers import OutFrame
from ipc.records import Delta, Error, Finish, FinishReason, Pause, Resume, Submit
from proxy.engine.batching import Batch, merge_deltas
from proxy.http.errors import ApiError, refused


class Phase(enum.IntEnum):
    """How far the daemon has got with a request, as far as the proxy knows; only moves on."""

    QUEUED = 0  # written (or being written); the daemon has said nothing of it yet
    ADMITTED = 1  # the daemon took it (Admitted): no request deadline any more
    STARTED = 2  # its first Delta, Finish or Error arrived: no longer waiting
    DONE = 3  # the reader took its Error, its last Finish, or one the daemon ended it with


class Flow:
    """Flow control shared by a proxy's sessions: its limits, and how a session's Pause or
    Resume reaches the daemon (`control` writes a control record; False if it could not)."""

    __slots__ = ("control", "high_water", "merge_tokens")

    def __init__(self, high_water: int, merge_tokens: int,
                 control: Callable[[Pause | Resume], bool]) -> None:
        self.high_water = high_water
        self.merge_tokens = merge_tokens
        self.control = control

    def send(self, session: Session, paused: bool) -> None:
        session.paused = paused
        if self.control(Pause(session.rid) if paused else Resume(session.rid)):
            session.pause_sent = paused  # else the sweep tries again


class Session:
    __slots__ = ("consumed", "deadline", "detached", "failure", "finished", "flow", "frame",
                 "held", "in_hand", "pause_sent", "paused", "phase", "records", "rid",
                 "seen_consumed", "sink", "stuck_since", "unfinished", "units", "waiter",
                 "weight")

    def __init__(self, submit: Submit, flow: Flow, detached: bool, deadline: float) -> None:
        self.rid = submit.rid
        self.flow = flow
        self.detached = detached  # a background response: the daemon runs it without a client
        self.phase = Phase.QUEUED
        self.deadline = deadline  # for the daemon's first record about it
        self.frame: OutFrame | None = None  # the Submit, while the proxy may still withdraw it
        self.failure: ApiError | None = None  # daemon lost, timed out, or proxy shutting down
        # A list, not a deque: an empty deque is 760 bytes, and thousands of sessions wait
        # with nothing buffered. The reader takes the whole list at once.
        self.records: list[Delta | Finish | Error] = []
        self.waiter: asyncio.Future[None] | None = None
        self.sink: Callable[[], None] | None = None
        self.in_hand: Batch | None = None  # taken, not yet handed on
        sequences = submit.num_sequences
        self.finished = bytearray(sequences)  # 1 per index once its Finish was taken
        self.unfinished = sequences
        # Flow control and stall detection.
        self.weight = 1 + (submit.sampling.logprobs or 0)
        self.units = 0  # weighted tokens held
        self.held = 0  # records held
        self.consumed = 0  # records handed on, ever
        self.seen_consumed = 0  # `consumed` at the last sweep
        self.stuck_since = 0.0  # since when held records have not moved
        self.paused = False  # what the daemon should do
        self.pause_sent = False  # what it was last told

    @property
    def complete(self) -> bool:
        """Every sequence's Finish was taken: nothing more will come."""
        return not self.unfinished

    # --- the tokens reader's side ---------------------------------------------------------------

    def started(self) -> bool:
        """A Delta, Finish or Error for it arrived; True the first time (it stops waiting)."""
        if self.phase >= Phase.STARTED:
            return False
        self.phase = Phase.STARTED
        self.frame = None  # the daemon has it: nothing to withdraw
        return True

    def admitted(self) -> None:
        if self.phase < Phase.ADMITTED:
            self.phase = Phase.ADMITTED
            self.frame = None

    def push(self, record: Delta | Finish | Error) -> bool:
        """Holds `record`; True if nothing else was waiting for the reader (wake it)."""
        self.records.append(record)
        self.held += 1
        if type(record) is Delta:
            self.units += len(record.token_ids) * self.weight
            if self.units > self.flow.high_water and not self.paused:
                self.flow.send(self, True)
        return len(self.records) == 1

    def wake(self) -> None:
        if self.sink is not None:
            self.sink()
        elif self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def fail(self, exc: ApiError) -> None:
        if self.failure is None:
            self.failure = exc
            self.wake()

    def lose(self, exc: ApiError) -> None:
        """The daemon is gone: fail, unless the records held already end the session (an
        Error, or a Finish for every sequence not yet finished). Its last records and its
        Goodbye can come in one read; the reader takes that end, and nothing is lost."""
        pending = {i for i, done in enumerate(self.finished) if not done}
        for record in self.records:
            if isinstance(record, Error):
                return
            if isinstance(record, Finish):
                pending.discard(record.index)
        if pending:
            self.fail(exc)

    # --- the reader's side ----------------------------------------------------------------------

    def take(self) -> Batch:
        """The held records up to the last Finish or an Error (raised at once if it comes
        first, else left for the next call), maybe none; raises the session's failure.
        Still held (`in_hand`) until `handed_on`: only then do they stop counting for flow
        control and stall detection. With merging on, each sequence's Deltas in the batch are
        merged (proxy/engine/batching.py)."""
        if self.failure is not None:
            raise self.failure  # what it still holds will never be read
        records = self.records
        if not records:
            return []
        end = len(records)
        for i, record in enumerate(records):
            if isinstance(record, Delta):
                continue
            if isinstance(record, Error):
                if i == 0:
                    self.phase = Phase.DONE
                    raise refused(record.reason, record.message, record.param)
                end = i
                break
            if record.reason is FinishReason.ABORT or record.reason is FinishReason.ERROR:
                self.phase = Phase.DONE  # the daemon evicts a session whole: nothing to abort
            if self._finished(record.index):
                self.phase = Phase.DONE
                end = i + 1
                break
        # Nothing can follow the last Finish.
        self.records = records[end:] if end < len(records) and not self.complete else []
        # The loop stopped before any Error: what it takes are Deltas and Finishes.
        batch: Batch = records if end == len(records) else records[:end]  # type: ignore[assignment]
        self.in_hand = batch
        merge = self.flow.merge_tokens
        return batch if merge <= 1 else merge_deltas(batch, merge)

    def _finished(self, index: int) -> bool:
        """Sequence `index` ended; True once every one has."""
        if 0 <= index < len(self.finished) and not self.finished[index]:
            self.finished[index] = 1
            self.unfinished -= 1
        return self.unfinished == 0

    def handed_on(self) -> None:
        """The reader handed on what it took last (for a stream: the socket took it)."""
        batch, self.in_hand = self.in_hand, None
        if batch is None:
            return
        self.held -= len(batch)
        self.consumed += len(batch)
        units = 0
        for record in batch:
            if type(record) is Delta:
                units += len(record.token_ids)
        self.units -= units * self.weight
        if self.paused and self.units <= self.flow.high_water // 2:
            self.flow.send(self, False)

    async def next_batch(self) -> Batch | None:
        """Hands on the last batch, then waits for the next; None once the session is complete.
        A reader that fell behind gets everything that arrived meanwhile at once."""
        self.handed_on()
        while not self.complete:
            batch = self.take()
            if batch:
                return batch
            # Waited for here, not in a coroutine of its own: thousands of requests can wait.
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
            self.waiter = None
        return None

    # --- the sweep's side -----------------------------------------------------------------------

    def needs_abort(self) -> bool:
        """Whether the daemon may still be working on it for nobody."""
        return self.phase is not Phase.DONE and self.failure is None

    def is_stuck(self, now: float, stall_s: float) -> bool:
        """Held records that the reader has not moved for `stall_s` (checked by a sweep)."""
        if not self.held or self.consumed != self.seen_consumed:
            self.seen_consumed = self.consumed
            self.stuck_since = now
            return False
        return now - self.stuck_since >= stall_s
