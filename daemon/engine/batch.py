"""What one step computes: the scheduler's chunks, and which sequences they give a token.

Built by the scheduler (daemon/engine/scheduler.py) chunk by chunk; the execute phase hands the
chunks to the runner and samples the rows `sampled` and `rows` name, and the scheduler's update
advances the sequences by them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from daemon.engine.sequence import Sequence
from daemon.model.batch import ScheduledChunk


@dataclass(slots=True)
class Batch:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)  # seqs[i] owns chunks[i]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # The sequences this pass gives a token (a prompt's forked siblings after it), and the row
    # of the runner's logits each samples from: known before the pass runs.
    sampled: list[Sequence] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    num_rows: int = 0  # rows of logits the runner returns
    # Speculative decoding: the drafts of the sequence at each index of `sampled` that has
    # any; its chunk is [last token] + drafts, a logits row each, the first at its `rows`.
    drafts: dict[int, list[int]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.chunks)

    def add_decodes(self, seqs: list[Sequence], forking: bool = True) -> None:
        """`add` of one token for each of `seqs` (one left to compute each), in one pass;
        `forking` False: none of them has siblings to fork."""
        self.chunks += [ScheduledChunk(s.token_ids[-1:], s.num_computed, s.block_table, True,
                                       s.wants_prompt_logits) for s in seqs]
        self.seqs += seqs
        decodes = sum(1 for s in seqs if s.num_computed >= s.num_prompt_tokens)
        self.num_decode_tokens += decodes
        self.num_prefill_tokens += len(seqs) - decodes
        start = self.num_rows
        self.num_rows += len(seqs)  # one token each, so one row each
        if forking:
            for row, seq in enumerate(seqs, start):
                self._sample(seq, row)
        else:
            self.sampled += seqs
            self.rows += range(start, self.num_rows)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        start = seq.num_computed
        end = start + num_tokens
        chunk = ScheduledChunk(seq.token_ids[start:end], start, seq.block_table,
                               end == seq.num_tokens, seq.wants_prompt_logits)
        self.chunks.append(chunk)
        self.seqs.append(seq)
        # A decode feeds back one sampled token; one token of a prompt (the rest cached,
        # or a chunk's tail) is still prefill.
        if num_tokens == 1 and start >= seq.num_prompt_tokens:
            self.num_decode_tokens += 1
        else:
            self.num_prefill_tokens += num_tokens
        self.num_rows += chunk.num_logit_rows
        if chunk.needs_logits:
            self._sample(seq, self.num_rows - 1)

    def add_drafted(self, seq: Sequence, drafts: list[int]) -> None:
        """A decode of the sequence's last token and `drafts` after it: a logits row for each
        position, to verify every draft and sample the token after the last accepted one."""
        chunk = ScheduledChunk([seq.token_ids[-1], *drafts], seq.num_computed, seq.block_table,
                               True, all_logits=True, drafted=True)
        self.chunks.append(chunk)
        self.seqs.append(seq)
        self.num_decode_tokens += len(chunk.token_ids)
        self.drafts[len(self.sampled)] = drafts
        self.sampled.append(seq)  # speculable: no siblings to fork
        self.rows.append(self.num_rows)
        self.num_rows += len(chunk.token_ids)

    def _sample(self, seq: Sequence, row: int) -> None:
        """`seq` and its siblings still to fork sample from logits row `row`."""
        self.sampled.append(seq)
        self.rows.append(row)
        for child in seq.fork_children:
            self.sampled.append(child)
            self.rows.append(row)
