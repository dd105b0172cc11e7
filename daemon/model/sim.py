"""A simulated model for tests and benchmarks: `--model sim:<ms>` (e.g. sim:0, sim:20).

A runner with no weights, not a second engine: each forward pass lasts <ms> milliseconds and
gives every sequence that needs logits one token, a word from a fixed list. Admission, the
scheduler, KV-block accounting and the prefix cache, sampling, detokenization, stop strings,
the pipes, aborts and metrics are the real code, so the proxy, a router and the load tests can
run at rates no CPU model reaches (sim:0 ticks as fast as the engine's own Python allows).

The vocabulary is the byte tokenizer's (prompts encode exactly as with builtin:tiny) plus one id
per word, so token counts, usage and `return_token_ids` are real. The next word depends only on
the position and the previous token, so the output is deterministic and the same whatever else
shares the batch. The model never chooses EOS: streams end at max_tokens or a stop string.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from daemon.model.batch import ScheduledChunk
from daemon.model.tokenizer import ByteTokenizer

WORDS = tuple(
    " " + w for w in (
        "the of and to in is that it for on was with as be by at this from or an are not "
        "have but they which one you were all we her she there would their will when who "
        "him been has more if no out do so can what up said about other into than its time "
        "only could new them man some these then two first may any like now my such make "
        "over our even most me state after also made many did must before back see through "
        "way where get much go well your know should down work year because come people just"
    ).split())
SIM_MAX_MODEL_LEN = 32768


class SimSpecError(ValueError):
    """`sim:<ms>` with something other than a number of milliseconds."""


def parse_spec(spec: str) -> float:
    """Tick duration in seconds from 'sim:<ms>'."""
    raw = spec.removeprefix("sim:")
    try:
        ms = float(raw)
    except ValueError:
        raise SimSpecError(f"--model {spec!r}: expected sim:<milliseconds per tick>, "
                           "e.g. sim:0 or sim:20") from None
    if not 0 <= ms <= 60_000:
        raise SimSpecError(f"--model {spec!r}: the tick must last 0..60000 ms, got {raw}")
    return ms / 1000.0


class SimTokenizer(ByteTokenizer):
    """The byte tokenizer plus one id per word of WORDS (ids from 260 on)."""

    def __init__(self) -> None:
        super().__init__()
        self.first_word_id = self.vocab_size
        self._word_bytes = [w.encode() for w in WORDS]
        self.vocab_size += len(WORDS)
        # Every id's bytes (a special's none): decoding is a lookup per id.
        self._bytes_of = [bytes((i,)) for i in range(256)] + [b""] * (self.first_word_id - 256)
        self._bytes_of += self._word_bytes

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        table, size = self._bytes_of, self.vocab_size
        return b"".join([table[i] for i in ids if 0 <= i < size])

    def token_bytes(self, token_id: int) -> bytes:
        if token_id >= self.first_word_id:
            return self._word_bytes[token_id - self.first_word_id]
        return super().token_bytes(token_id)


class SimRunner:
    """The Runner protocol without a model: KV positions are checked against the block tables,
    never stored."""

    def __init__(self, tokenizer: SimTokenizer, num_blocks: int, tick_s: float,
                 block_size: int = 16) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tick_s = tick_s
        self.vocab_size = tokenizer.vocab_size
        self.first_word_id = tokenizer.first_word_id
        # Every row before its word: each other text token possible but never chosen beside the
        # word (e^-30), so that a grammar's mask leaves something to sample; special ids never.
        self._row = torch.full((1, self.vocab_size), -30.0)
        self._row[:, 256:self.first_word_id] = float("-inf")

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        deadline = time.monotonic() + self.tick_s
        size = self.block_size
        for i, c in enumerate(chunks):
            end = c.start_pos + len(c.token_ids)
            if len(c.block_table) * size < end:
                raise ValueError(f"chunk {i}: block_table has {len(c.block_table)} blocks, "
                                 f"too few for {end} positions of {size}")
        first, count = self.first_word_id, len(WORDS)
        # Each logits row's word, from the token before it and its position: after a chunk's
        # last token, or after every one (prompt logprobs).
        words = [first + (c.token_ids[j] * 31 + c.start_pos + j) % count for c in chunks
                 for j in (range(len(c.token_ids)) if c.all_logits
                           else (len(c.token_ids) - 1,) if c.needs_logits else ())]
        logits = self._row.repeat(len(words), 1)
        if words:
            logits[torch.arange(len(words)), torch.tensor(words)] = 0.0
        if self.tick_s:
            time.sleep(max(0.0, deadline - time.monotonic()))
        return logits

    def copy_block(self, src: int, dst: int) -> None:
        pass  # no KV to copy; the block manager's accounting is what the simulation keeps
