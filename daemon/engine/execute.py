"""The step's execute phase: the forward pass, and sampling beside it.

Which sequences a pass gives a token, and from which row of its logits, is known before it
runs (`Batch.sampled`, `Batch.rows`): the constrained ones' grammar masks are computed while it
runs. The sampled ids stay where the logits are (on a GPU, the device) until the update phase
reads them; so do those rows of the logits, for the log-probabilities of the tokens finally
emitted (constrained decoding may put its closing's token in place of a sampled one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from daemon.engine.batch import Batch
from daemon.engine.guided import Guidance, Masks
from daemon.engine.sampler import Logprob, Sampler, prompt_logprobs
from daemon.engine.sequence import Sequence
from daemon.model.batch import ScheduledChunk
from ipc.records import TokenLogprob


class Runner(Protocol):
    block_size: int
    num_blocks: int

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor: ...
    def copy_block(self, src: int, dst: int) -> None: ...


@dataclass(slots=True)
class Executed:
    """What a pass sampled. A sequence may get several tokens a step (speculative decoding):
    `ids` is then each sequence's list, and `logits` has a row per id in that order, the
    first of sequence i's at `starts[i]`; one token a sequence, `ids` is a tensor of one id
    per sequence, and sequence i's logits are row i."""

    seqs: list[Sequence]
    ids: torch.Tensor | list[list[int]]
    logits: torch.Tensor
    masks: Masks | None = None  # the grammar masks the ids were sampled under
    starts: list[int] | None = None
    # Speculative decoding: the drafts verified, by index in `seqs` (Batch.drafts); a drafted
    # sequence's ids are those sampled at each of its rows (a constrained one's each under the
    # mask after the drafts before it), to verify its drafts against.
    drafts: dict[int, list[int]] = field(default_factory=dict)

    def rows(self) -> list[list[int]]:
        """Each sequence's ids, on the host (the step's one read of the device)."""
        ids = self.ids
        if not isinstance(ids, torch.Tensor):
            return ids
        flat = ids.tolist()
        if self.starts is None:
            return [[token] for token in flat]
        ends = [*self.starts[1:], len(flat)]
        return [flat[start:end] for start, end in zip(self.starts, ends, strict=True)]


class Executor:
    def __init__(self, runner: Runner, sampler: Sampler, guidance: Guidance | None,
                 to_token_logprob: Callable[[int, Logprob], TokenLogprob]) -> None:
        self.runner = runner
        self.sampler = sampler
        self.guidance = guidance
        self.to_token_logprob = to_token_logprob

    def __call__(self, batch: Batch) -> Executed:
        seqs = batch.sampled
        # A fork's siblings share their prompt's grammar, so they are among `seqs` too.
        guidance = self.guidance if self.guidance is not None and any(
            [s.constraint is not None for s in seqs]) else None
        masks = guidance.start_masks(seqs, batch.drafts) if guidance is not None else None
        logits = self.runner.run(batch.chunks)
        if any([chunk.all_logits for chunk in batch.chunks]):
            prompt_logprobs(batch.chunks, batch.seqs, logits, self.to_token_logprob)
        if not seqs:
            return Executed([], [], logits[:0])
        sampled, rows, starts, ahead = _sampled_rows(batch)
        if len(rows) != logits.shape[0] or rows[-1] != len(rows) - 1:  # not each row once
            logits = logits[torch.tensor(rows, device=logits.device)]
        masked = guidance.mask(logits, masks) if guidance is not None else logits
        return Executed(seqs, self.sampler.sample(masked, sampled, ahead), logits, masks, starts,
                        batch.drafts)


def _sampled_rows(batch: Batch) -> tuple[list[Sequence], list[int], list[int] | None,
                                         list[list[int]] | None]:
    """The sequence and the logits row of each row to sample, where each sequence's rows start
    (None: one each), and the drafts each row follows (its penalties and bans count them). A
    drafted sequence samples every row of its chunk (each position's next token)."""
    if not batch.drafts:
        return batch.sampled, batch.rows, None, None
    seqs: list[Sequence] = []
    rows: list[int] = []
    starts: list[int] = []
    ahead: list[list[int]] = []
    for i, (seq, row) in enumerate(zip(batch.sampled, batch.rows, strict=True)):
        drafts = batch.drafts.get(i, [])
        n = 1 + len(drafts)
        starts.append(len(rows))
        seqs += [seq] * n
        rows += range(row, row + n)
        ahead += [drafts[:j] for j in range(n)]
    return seqs, rows, starts, ahead
