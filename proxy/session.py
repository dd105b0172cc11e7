"""One request's state in the proxy: the records its reader has not taken yet, its deadline, and
how much of it the client has not read (flow control).

A session is a few slots, a list and at most one future, so thousands of held streams stay
cheap. "Held" records were pushed by the tokens reader and not yet handed on, which for a stream
means not yet taken by the socket; "units" weigh them by what they cost to keep (a token
counts once, plus once per log-probability alternative), and drive Pause and Resume.

Its reader is woken once per read of the tokens pipe that brought it records (or when it
fails): either the coroutine waiting on `waiter`, or a `sink` called right there, which writes
them to the client without a task switch (proxy/token_stream.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ipc.proxy_writers import OutFrame
from ipc.records import Delta, Error, Finish, FinishReason, Submit
from proxy.errors import ApiError


class Session:
    __slots__ = ("acked", "complete", "consumed", "deadline", "detached", "failure", "finished",
                 "frame", "held", "in_hand", "pause_sent", "paused", "records", "rejected",
                 "rid", "seen_consumed", "sink", "started", "stuck_since", "unfinished", "units",
                 "waiter", "weight")

    def __init__(self, submit: Submit, sequences: int, detached: bool, deadline: float) -> None:
        self.rid = submit.rid
        self.detached = detached  # a background response: the daemon runs it without a client
        # A list, not a deque: an empty deque is 760 bytes, and thousands of sessions wait
        # with nothing buffered. The reader takes the whole list at once.
        self.records: list[Delta | Finish | Error] = []
        self.waiter: asyncio.Future[None] | None = None
        self.sink: Callable[[], None] | None = None
        self.in_hand: list[Delta | Finish] | None = None  # taken, not yet handed on
        self.finished = bytearray(sequences)  # 1 per index once its Finish arrived
        self.unfinished = sequences
        self.frame: OutFrame | None = None  # the Submit, while the proxy may still withdraw it
        self.deadline = deadline  # for the daemon's first record about it
        self.acked = False  # the daemon has sent a record for it (Admitted included)
        self.started = False  # the daemon has sent a Delta, Finish or Error for it
        self.complete = False  # every sequence finished
        self.rejected = False  # the daemon answered with an Error record, or ended it itself
        self.failure: ApiError | None = None  # daemon lost, timed out, or proxy shutting down
        # Flow control and stall detection.
        self.weight = 1 + (submit.sampling.logprobs or 0)
        self.units = 0  # weighted tokens held
        self.held = 0  # records held
        self.consumed = 0  # records handed on, ever
        self.seen_consumed = 0  # `consumed` at the last sweep
        self.stuck_since = 0.0  # since when held records have not moved
        self.paused = False  # what the daemon should do
        self.pause_sent = False  # what it was last told

    def push(self, record: Delta | Finish | Error) -> bool:
        """Holds `record`; True if nothing else was waiting for the reader (wake it)."""
        self.records.append(record)
        self.held += 1
        if type(record) is Delta:
            self.units += len(record.token_ids) * self.weight
        return len(self.records) == 1

    def take(self) -> list[Delta | Finish]:
        """The held records up to the last Finish or an Error (raised at once if it comes
        first, else left for the next call); still held (`in_hand`) until `handed_on`."""
        records = self.records
        end = len(records)
        for i, record in enumerate(records):
            if isinstance(record, Delta):
                continue
            if isinstance(record, Error):
                if i == 0:
                    self.rejected = True
                    raise ApiError(record.status, record.message, record.param, record.code)
                end = i
                break
            if record.reason is FinishReason.ABORT or record.reason is FinishReason.ERROR:
                self.rejected = True  # the daemon evicts a session whole: nothing to abort
            if self._finished(record.index):
                self.complete = True
                end = i + 1
                break
        # Nothing can follow the last Finish.
        self.records = records[end:] if end < len(records) and not self.complete else []
        # The loop stopped before any Error: what it takes are Deltas and Finishes.
        batch: list[Delta | Finish] = records if end == len(records) else records[:end]  # type: ignore[assignment]
        self.in_hand = batch
        return batch

    def _finished(self, index: int) -> bool:
        """Sequence `index` ended; True once every one has."""
        if 0 <= index < len(self.finished) and not self.finished[index]:
            self.finished[index] = 1
            self.unfinished -= 1
        return self.unfinished == 0

    def wake(self) -> None:
        if self.sink is not None:
            self.sink()
        elif self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

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

    def fail(self, exc: ApiError) -> None:
        if self.failure is None:
            self.failure = exc
            self.wake()

    def needs_abort(self) -> bool:
        return not (self.complete or self.rejected or self.failure is not None)

    def is_stuck(self, now: float, stall_s: float) -> bool:
        """Held records that the reader has not moved for `stall_s` (checked by a sweep)."""
        if not self.held or self.consumed != self.seen_consumed:
            self.seen_consumed = self.consumed
            self.stuck_since = now
            return False
        return now - self.stuck_since >= stall_s
