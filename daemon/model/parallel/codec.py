"""What rank 0 and the other ranks say on the control group: the ops, a batch, a rank's figures.

A batch crosses as one int64 tensor:
``[RUN, chunks, copies, (src, dst) * copies, (start_pos, logits, tokens, blocks,
token ids..., block ids...) * chunks]`` (logits: 1 for needs_logits, plus 2 for all_logits).
Copy-on-write block copies ride with the next batch: the other ranks only need them done before
their next forward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from daemon.model.batch import ScheduledChunk
from daemon.model.parallel.group import TPGroup

RUN, INIT, REPORT = 1, 2, 3


def encode_run(chunks: Sequence[ScheduledChunk], copies: Sequence[tuple[int, int]]) -> Tensor:
    out = [RUN, len(chunks), len(copies)]
    for src, dst in copies:
        out += (src, dst)
    for c in chunks:
        out += (c.start_pos, int(c.needs_logits) + 2 * c.all_logits, len(c.token_ids),
                len(c.block_table))
        out += c.token_ids
        out += c.block_table
    return torch.tensor(out, dtype=torch.long)


def decode_run(message: Tensor) -> tuple[list[ScheduledChunk], list[tuple[int, int]]]:
    values = message.tolist()
    num_chunks, num_copies = values[1], values[2]
    copies = [(values[3 + 2 * i], values[4 + 2 * i]) for i in range(num_copies)]
    at = 3 + 2 * num_copies
    chunks: list[ScheduledChunk] = []
    for _ in range(num_chunks):
        start, logits, n_tokens, n_blocks = values[at : at + 4]
        at += 4
        tokens = values[at : at + n_tokens]
        blocks = values[at + n_tokens : at + n_tokens + n_blocks]
        at += n_tokens + n_blocks
        chunks.append(ScheduledChunk(tokens, start, blocks, bool(logits & 1), bool(logits & 2)))
    return chunks, copies


@dataclasses.dataclass(slots=True)
class RankFigures:
    """One rank's own count of what it ran (REPORT): for benchmarks and tests."""

    rank: int
    num_runs: int = 0
    num_tokens: int = 0
    collective_s: float = 0.0  # all-reduces and the logits gather
    num_collectives: int = 0
    send_s: float = 0.0  # rank 0: broadcasting the batches
    last_block_ids: list[int] = dataclasses.field(default_factory=list)

    def ran(self, chunks: Sequence[ScheduledChunk], group: TPGroup) -> None:
        self.num_runs += 1
        self.num_tokens += sum(len(c.token_ids) for c in chunks)
        self.collective_s, self.num_collectives = group.collective_s, group.num_collectives
        self.last_block_ids = sorted({b for c in chunks for b in c.block_table})
