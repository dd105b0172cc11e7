"""Sequences (one generated choice each) and sessions (one request: all its sequences)."""

from __future__ import annotations

import bisect
import enum
import itertools
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from daemon.engine.stops import StopMatcher
from ipc.records import FinishReason, RequestKind, SamplingParams, TokenLogprob, Usage

if TYPE_CHECKING:
    from daemon.engine.constraint import Constraint
    from daemon.engine.echo import Echo

# Ticks remembered per session to attribute sampled tokens to "after the client left".
_TICK_MEMORY = 4096

_seq_ids = itertools.count()


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


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class SeqStatus(enum.Enum):
    NEW = "new"  # built, not given to the scheduler yet (a guided one waits for its grammar)
    WAITING = "waiting"  # no blocks; in the scheduler's waiting queue
    RUNNING = "running"  # holds blocks; in the scheduler's running list
    FORK_PENDING = "fork_pending"  # a sibling of a prompt still being prefilled
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    rid: str
    index: int
    token_ids: list[int]
    params: SamplingParams
    detok: Detokenizer
    stops: StopMatcher
    seed: int | None = None  # this choice's generator seed (sampler.seed_for)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_prompt_tokens: int = 0
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    # Prefix-cache hashes of the first full blocks of token_ids (block_manager.chain_hashes).
    block_hashes: list[bytes] = field(default_factory=list)
    # Prompt tokens found in the prefix cache when first admitted; None until then.
    num_cached_tokens: int | None = None
    status: SeqStatus = SeqStatus.NEW
    finish_reason: FinishReason | None = None
    # Siblings forked from this sequence's blocks once its prompt is prefilled.
    fork_children: list[Sequence] = field(default_factory=list)
    output_pieces: list[str] = field(default_factory=list)  # its text so far, joined at the end
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)  # when params.logprobs
    rng: Any = None  # the sampler's torch.Generator, created lazily from `seed`
    paused: bool = False  # flow control: not scheduled until resumed (Scheduler.set_paused)
    constraint: Constraint | None = None  # what its output must match (guided decoding)
    # Tokens it may generate: params.max_tokens, or the rest of the context (admission).
    max_tokens: int = 0
    bad_words: list[list[int]] = field(default_factory=list)  # as token sequences
    penalty_row: int | None = None  # its row of token counts in the sampler (penalties)
    echo: Echo | None = None  # its prompt, until its answer has started with it
    # A draw at temperature 1 from the model's distribution is all its sampling asks (no
    # seed, bias, ban, penalty, min_tokens, truncation or logprobs): what a client that sets
    # nothing gets. The sampler takes such a batch in one step (Sampler.__call__).
    plain_draw: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        if not self.max_tokens and self.params.max_tokens is not None:
            self.max_tokens = self.params.max_tokens
        p = self.params
        self.plain_draw = (p.temperature == 1.0 and self.seed is None and p.logprobs is None
                           and p.top_p >= 1.0 and p.top_k <= 0 and p.min_p == 0.0
                           and p.min_tokens == 0 and not p.logit_bias and not self.bad_words
                           and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
                           and p.repetition_penalty == 1.0)

    @property
    def wants_prompt_logits(self) -> bool:
        """Its prefill must give logits at every prompt position (echo with logprobs)."""
        return self.echo is not None and not self.echo.complete

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=self.num_generated,
                     cached_tokens=self.num_cached_tokens or 0)


@dataclass(slots=True, eq=False)
class Session:
    rid: str
    epoch: int
    kind: RequestKind
    sequences: list[Sequence]
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
        return "".join(self.sequences[0].output_pieces) if self.sequences else ""

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
