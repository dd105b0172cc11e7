"""One request's state in the proxy: the records its reader has not taken yet, its deadline, and
how much of it the client has not read (flow control).

A session is a few slots, a list and at most one future, so thousands of held streams stay
cheap. "Held" records were pushed by the tokens reader and not yet consumed, which for a stream
means not yet handed to the socket; "units" weigh them by what they cost to keep (a token
counts once, plus once per log-probability alternative), and drive Pause and Resume.
"""

from __future__ import annotations

import asyncio

from ipc.proxy_writers import OutFrame
from ipc.records import Delta, Error, Finish, Submit
from proxy.errors import ApiError


class Session:
    __slots__ = ("acked", "complete", "consumed", "deadline", "detached", "failure", "finished",
                 "frame", "held", "pause_sent", "paused", "records", "rejected", "rid",
                 "seen_consumed", "started", "stuck_since", "unfinished", "units", "waiter",
                 "weight")

    def __init__(self, submit: Submit, sequences: int, detached: bool, deadline: float) -> None:
        self.rid = submit.rid
        self.detached = detached  # a background response: the daemon runs it without a client
        # A list, not a deque: an empty deque is 760 bytes, and thousands of sessions wait
        # with nothing buffered. The reader takes the whole list at once.
        self.records: list[Delta | Finish | Error] = []
        self.waiter: asyncio.Future[None] | None = None
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

    def push(self, record: Delta | Finish | Error) -> None:
        self.records.append(record)
        self.held += 1
        if type(record) is Delta:
            self.units += len(record.token_ids) * self.weight
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def taken(self, record: Delta | Finish | Error) -> None:
        """The reader handed `record` on (for a stream: the socket took it)."""
        self.held -= 1
        self.consumed += 1
        if type(record) is Delta:
            self.units -= len(record.token_ids) * self.weight

    def fail(self, exc: ApiError) -> None:
        if self.failure is None:
            self.failure = exc
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(None)

    def needs_abort(self) -> bool:
        return not (self.complete or self.rejected or self.failure is not None)

    def is_stuck(self, now: float, stall_s: float) -> bool:
        """Held records that the reader has not moved for `stall_s` (checked by a sweep)."""
        if not self.held or self.consumed != self.seen_consumed:
            self.seen_consumed = self.consumed
            self.stuck_since = now
            return False
        return now - self.stuck_since >= stall_s
