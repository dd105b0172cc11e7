"""Sequences: one generated choice each, as the scheduler and the sampler see it.

A choice is two objects: its `Sequence` (token ids, positions, blocks, prefill progress, status,
and what its sampling asks for) and its `Output` (daemon/engine/output.py: detokenizer, stop
strings, what has not been sent yet). The scheduler and the sampler see only the first; the
step's emit phase reads it. Its session (daemon/engine/session.py) holds both.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ipc.records import FinishReason, SamplingParams, Usage

if TYPE_CHECKING:
    from daemon.engine.constraint import Constraint
    from daemon.engine.echo import Echo

_seq_ids = itertools.count()


class SeqStatus(enum.Enum):
    NEW = "new"  # built, not given to the scheduler yet (a guided one waits for its grammar)
    WAITING = "waiting"  # no blocks; in the scheduler's waiting queue
    RUNNING = "running"  # holds blocks; in the scheduler's running list
    FORK_PENDING = "fork_pending"  # a sibling of a prompt still being prefilled
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """What the scheduler and the sampler know of a choice; its output is not here."""

    rid: str
    index: int
    token_ids: list[int]
    params: SamplingParams
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
    rng: Any = None  # the sampler's torch.Generator, created lazily from `seed`
    paused: bool = False  # flow control: not scheduled until resumed (Scheduler.set_paused)
    constraint: Constraint | None = None  # what its output must match (guided decoding)
    # Tokens it may generate: params.max_tokens, or the rest of the context (admission).
    max_tokens: int = 0
    bad_words: list[list[int]] = field(default_factory=list)  # as token sequences
    penalty_row: int | None = None  # its row of token counts in the sampler (penalties)
    # Echo with logprobs: where its prompt's log-probabilities are gathered as its prompt is
    # computed (the scheduler asks the runner for every prompt position's logits meanwhile);
    # None once its prompt is computed, or when nothing is to be gathered.
    prompt_logprobs: Echo | None = None
    # Speculative decoding's back-off (speculative.py): steps to go without drafts, and how
    # many of its drafts in a row were all rejected. No draft itself outlives its step.
    draft_wait: int = 0
    draft_misses: int = 0
    draft_sure: int = 0  # of this step's drafts, the first ones its grammar forces
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
        echo = self.prompt_logprobs
        return echo is not None and not echo.complete

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
