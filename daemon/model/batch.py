"""What the scheduler hands the model runner: tokens of one sequence for one forward pass.

Torch-free, so that the scheduler (daemon/engine/) can build it without importing the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens of one sequence for one forward pass (the model runner's input)."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    needs_logits: bool
    # Logits at every token, not only the last (prompt logprobs; a speculative decode's drafts).
    all_logits: bool = False
    # A speculative decode ([last token] + drafts): run as one-token decodes at consecutive
    # positions, each row as decoding it alone would compute it (a prompt's chunk with
    # all_logits is a prefill: LongRoPE, say, chooses by the chunk's end, not each row's).
    drafted: bool = False

    @property
    def num_logit_rows(self) -> int:
        """Rows of logits the runner returns for this chunk."""
        return len(self.token_ids) if self.all_logits else int(self.needs_logits)
