"""The step's update phase, token by token: a sequence's new tokens join its ids up to the one
that ends it (a stop token, its max_tokens, the context), and what the emit phase is handed.

A sequence may get several tokens a step (speculative decoding): those after the first that
ends it are dropped here.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.engine.sequence import Sequence
from ipc.records import FinishReason, TokenLogprob


@dataclass(slots=True)
class Advanced:
    """The sequences a step gave tokens, each one's tokens (appended to its ids already),
    their log-probabilities (None: not asked for) and how its last token ends it (None: it goes
    on; STOP: a stop token, whose text is not shown; LENGTH)."""

    seqs: list[Sequence]
    rows: list[list[int]]
    logprobs: list[list[TokenLogprob] | None]
    ended: list[FinishReason | None]


class Ends:
    """Which token ends a sequence, as far as tokens alone say (stop strings are the emit
    phase's)."""

    def __init__(self, eos_token_ids: list[int], max_model_len: int) -> None:
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def append(self, seqs: list[Sequence], rows: list[list[int]]) -> list[FinishReason | None]:
        """Appends each row's tokens to its sequence's ids up to the first that ends it (a
        stop token: STOP; its max_tokens or the context: LENGTH), cutting the row there (in
        place); how each row's last token ends its sequence, if it does."""
        eos, max_model_len = self.eos, self.max_model_len
        ended: list[FinishReason | None] = []
        for seq, row in zip(seqs, rows, strict=True):
            token_ids = seq.token_ids
            start = len(token_ids)
            p = seq.params
            reason = None
            for token in row:
                token_ids.append(token)
                num_tokens = len(token_ids)  # read once: this runs for every token of every stream
                generated = num_tokens - seq.num_prompt_tokens
                if generated >= p.min_tokens and (
                        token in p.stop_token_ids or (token in eos and not p.ignore_eos)):
                    reason = FinishReason.STOP
                elif generated >= seq.max_tokens or num_tokens >= max_model_len:
                    reason = FinishReason.LENGTH
                else:
                    continue
                del row[num_tokens - start:]  # the tokens after this one are not its own
                break
            ended.append(reason)
        return ended
