"""Whom the scheduler preempts (daemon/engine/scheduler.py does the preempting: a preempted
sequence frees its blocks and is recomputed from its tokens later).

Two occasions: a running sequence short of blocks for this tick (`reserve_victim`), and a
request within its share whose next group does not fit (`room_victim`: room taken back from a
big request, Turns.big). Both choose among the running sequences, newest first.
"""

from __future__ import annotations

from daemon.engine.block_manager import BlockManager
from daemon.engine.sequence import Sequence
from daemon.engine.turns import Request, Shares, Turns, slots_of


def reserve_victim(seq: Sequence, running: list[Sequence], scheduled: set[int],
                   turns: Turns) -> Sequence | None:
    """Whom `seq` takes blocks from: a paused sequence; else a prompt chunk takes the
    newest that came after it (the oldest prompt always gets on: prefills never take turns
    preempting each other). A decode of a request with more slots than makes it big
    (Turns.big) takes its own newest (`seq` itself, maybe); another decode the newest of
    the request with the most slots beyond that, or the newest of all."""
    candidates = [v for v in reversed(running) if v.seq_id not in scheduled]
    others = [v for v in candidates if v is not seq]
    paused = next((v for v in others if v.paused), None)
    if paused is not None:
        return paused
    if seq.num_uncomputed > 1:
        return next(iter(candidates[:candidates.index(seq)]), None)
    requests = turns.requests
    big = turns.big(turns.shares()).slots
    if requests[seq.rid].slots > big:
        return next(v for v in candidates if v.rid == seq.rid)
    big_others = [v for v in others if requests[v.rid].slots > big]
    return max(big_others, key=lambda v: requests[v.rid].slots, default=None) or next(
        iter(others), None)


def room_victim(rid: str, request: Request, seq: Sequence, short: tuple[int, int], shares: Shares,
                running: list[Sequence], turns: Turns, block_manager: BlockManager) -> Sequence | None:
    """The next sequence to preempt for `request`, None if it cannot be given room."""
    # Only a big request gives way (Turns.big), and it keeps what makes it big and what
    # this request will hold: no request is made poorer than the one it gives way to, so
    # nothing swings back.
    keep = max(turns.big(shares).slots, request.slots + slots_of(seq))
    others = [v for v in reversed(running) if v.rid != rid]
    if short[0]:
        requests = turns.requests
        candidates = [v for v in others if requests[v.rid].slots - slots_of(v) >= keep]
        if min(len(candidates), turns.excess_slots(rid, keep)) < short[0]:
            return None  # all that is over a share would not do: it waits
    elif block_manager.num_blocks_for(seq.num_tokens) * slots_of(seq) <= shares.blocks:
        candidates = others  # blocks only for a group whose prompts fit in a share
    else:
        return None
    return turns.heaviest(candidates, turns.loads(running, shares))
