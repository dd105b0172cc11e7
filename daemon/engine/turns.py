"""Requests take turns, not sequences: who is waiting, what each request holds, and its share.

The scheduler serves prompt chunks and admissions request by request, the one served longest
ago first, so a request's many sequences (256 prompts, or n=64) count as one turn against
another request's one. While others want theirs, a request's share is 1/N of the sequence slots
and of the KV blocks (N: the requests running or waiting); alone, it is the whole engine.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import NamedTuple

from daemon.engine.sequence import Sequence


class Shares(NamedTuple):
    """What each request may hold while others want their turn."""

    slots: int
    blocks: int


def slots_of(seq: Sequence) -> int:
    """Sequence slots a sequence takes when it runs: its own and its siblings' still to fork."""
    return 1 + len(seq.fork_children)


@dataclass(slots=True, eq=False)
class Request:
    """One request in the scheduler: its waiting sequences, in the order they go, and the
    slots its running ones hold."""

    waiting: deque[Sequence] = field(default_factory=deque)
    slots: int = 0

    @property
    def next(self) -> Sequence | None:
        """The sequence to admit next; a paused request waits without holding up others."""
        if self.waiting and not self.waiting[0].paused:
            return self.waiting[0]
        return None


class Turns:
    def __init__(self, max_num_seqs: int, num_blocks: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.num_blocks = num_blocks
        # In turn order: the request whose prefill was served longest ago first.
        self.requests: OrderedDict[str, Request] = OrderedDict()
        self.num_waiting = 0
        self.num_slots_used = 0

    def waiting(self) -> list[Sequence]:
        return [s for r in self.requests.values() for s in r.waiting]

    # --- sequences in and out -------------------------------------------------------------------

    def queue(self, seq: Sequence) -> None:
        """A sequence waits, at the end of its request's line."""
        self._request(seq.rid).waiting.append(seq)
        self.num_waiting += 1

    def requeue(self, seq: Sequence, *, first: bool) -> None:
        """A preempted sequence waits first in its request's line; its request goes first in
        the order (back in before anyone new: out of blocks) or last (it gave way to
        another request: it waits its turn)."""
        self._request(seq.rid).waiting.appendleft(seq)
        self.requests.move_to_end(seq.rid, last=not first)
        self.num_waiting += 1

    def _request(self, rid: str) -> Request:
        request = self.requests.get(rid)
        if request is None:
            request = self.requests[rid] = Request()
        return request

    def start(self, request: Request) -> Sequence:
        """The request's next sequence leaves the line to run."""
        seq = request.waiting.popleft()
        self.num_waiting -= 1
        self._hold(seq.rid, slots_of(seq))
        return seq

    def stop(self, seq: Sequence) -> None:
        """A running sequence gives its slots back (preempted or gone)."""
        self._hold(seq.rid, -slots_of(seq))

    def drop(self, seq: Sequence) -> None:
        """A waiting sequence leaves the line for good."""
        self.requests[seq.rid].waiting.remove(seq)
        self.num_waiting -= 1

    def forget_if_idle(self, rid: str) -> None:
        request = self.requests.get(rid)
        if request is not None and not request.waiting and not request.slots:
            del self.requests[rid]

    def served(self, rids: list[str]) -> None:
        """These requests had a turn this tick: to the back of the order, in that order."""
        for rid in rids:
            self.requests.move_to_end(rid)

    def _hold(self, rid: str, slots: int) -> None:
        self.requests[rid].slots += slots
        self.num_slots_used += slots

    # --- shares ---------------------------------------------------------------------------------

    def shares(self) -> Shares:
        active = max(1, sum(1 for r in self.requests.values() if r.slots or r.next is not None))
        return Shares(max(1, self.max_num_seqs // active), max(1, self.num_blocks // active))

    @staticmethod
    def within_share(request: Request, share: int) -> bool:
        """Whether the request's next group keeps it within its share of the slots; one that
        holds nothing always is (its first group is what it waits for)."""
        seq = request.next
        return not request.slots or request.slots + (slots_of(seq) if seq else 0) <= share

    def big(self, shares: Shares) -> Shares:
        """What a request holds beyond to count as big: its share, and a quarter of the
        engine (requests of a few sequences each queue in turn: preempting one another would
        only churn)."""
        return Shares(max(shares.slots, self.max_num_seqs // 4),
                      max(shares.blocks, self.num_blocks // 4))

    def loads(self, running: list[Sequence], shares: Shares) -> dict[str, float]:
        """How big each running request is, in slots or in blocks (> 1: big, see `big`)."""
        big = self.big(shares)
        blocks: dict[str, int] = {}
        for seq in running:  # a block shared by siblings counts once per holder
            blocks[seq.rid] = blocks.get(seq.rid, 0) + len(seq.block_table)
        return {rid: max(self.requests[rid].slots / big.slots, n / big.blocks)
                for rid, n in blocks.items()}

    def excess_slots(self, rid: str, keep: int) -> int:
        """Slots the other requests hold beyond `keep` each."""
        return sum(max(0, r.slots - keep) for other, r in self.requests.items() if other != rid)

    @staticmethod
    def heaviest(candidates: list[Sequence], loads: dict[str, float]) -> Sequence | None:
        """The newest of `candidates` (newest first) of the biggest big request."""
        over = [v for v in candidates if loads[v.rid] > 1]
        return max(over, key=lambda v: loads[v.rid], default=None)
