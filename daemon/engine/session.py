"""A session: one request in the engine, which owns all it holds (its sequences and their
outputs; the engine's `_evict` releases their blocks, its placeholder and its grammar with it)."""

from __future__ import annotations

import bisect
from array import array
from dataclasses import dataclass, field

from daemon.engine.output import Output
from daemon.engine.sequence import Sequence
from ipc.records import FinishReason, RequestKind, Usage

# Ticks remembered per session to attribute sampled tokens to "after the client left".
_TICK_MEMORY = 4096


class TickHistory:
    """(start time, tokens sampled) of one session's ticks, oldest first, in two flat arrays:
    12 bytes a tick rather than a tuple of boxed numbers. Past the limit the oldest half goes."""

    __slots__ = ("counts", "starts")

    def __init__(self) -> None:
        self.starts = array("d")
        self.counts = array("I")

    def __len__(self) -> int:
        return len(self.starts)

    def append(self, start: float, tokens: int) -> None:
        if len(self.starts) >= _TICK_MEMORY:
            del self.starts[: _TICK_MEMORY // 2]
            del self.counts[: _TICK_MEMORY // 2]
        self.starts.append(start)
        self.counts.append(tokens)

    def after(self, t: float) -> tuple[int, int]:
        """(ticks, tokens) of the ticks that started after time `t`."""
        first = bisect.bisect_right(self.starts, t)
        return len(self.starts) - first, sum(self.counts[first:])

    def tail(self, count: int) -> list[tuple[float, int]]:
        """The newest `count` ticks as (start, tokens), oldest first."""
        return list(zip(self.starts[-count:], self.counts[-count:], strict=True))


@dataclass(slots=True, eq=False)
class Session:
    rid: str
    epoch: int
    kind: RequestKind
    sequences: list[Sequence]
    outputs: list[Output]  # outputs[i] is sequences[i]'s (index order)
    t_arrival: float
    # Set when the response store holds a queued/in_progress row for this rid.
    placeholder: bool = False
    background: bool = False  # a background response: its client leaving does not end it
    t_disconnect: float | None = None
    paused: bool = False  # the proxy asked to stop scheduling it (its client is not reading)
    client_id: str | None = None  # the client's X-Request-Id, for the request log
    # (tick start, tokens sampled for this session in that tick), newest last.
    ticks: TickHistory = field(default_factory=TickHistory)

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.sequences)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(s.num_prompt_tokens for s in self.sequences)

    @property
    def num_generated(self) -> int:
        return sum(s.num_generated for s in self.sequences)

    @property
    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, self.num_generated,
                     sum(s.num_cached_tokens or 0 for s in self.sequences))

    def output_text(self) -> str:
        return self.outputs[0].text() if self.outputs else ""

    def tokens_after(self, t: float) -> tuple[int, int]:
        """(ticks, tokens) of this session's ticks that started after time `t`."""
        return self.ticks.after(t)

    def end(self, reason: FinishReason) -> list[Sequence]:
        """Ends every sequence still going with `reason` (ABORT or ERROR) and returns them, for
        the engine to release and report."""
        ended = [s for s in self.sequences if not s.is_finished]
        for seq in ended:
            seq.finish_reason = reason
        return ended
