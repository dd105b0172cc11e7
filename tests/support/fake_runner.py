"""A model runner for engine tests: a paged "KV cache" of token ids and a scripted next token.

It reads every context token back through the block table, so a wrong table (a fork that did
not copy, a preemption that did not recompute) produces a wrong token, not a silent pass.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable

import torch

from daemon.model.batch import ScheduledChunk

SPECIAL_IDS = 256  # the byte tokenizer: ids 0..255 are bytes, the rest are special

Script = Callable[[list[int]], int]


def hash_script(vocab: int) -> Script:
    """A deterministic 'model': the next token is a hash of the whole context, never a special
    id (a hash landing on EOS made a test that needs no EOS pass or fail by the random draws
    of the tests before it)."""
    return lambda ctx: zlib.crc32(bytes(str(ctx), "ascii")) % vocab % SPECIAL_IDS


class FakeRunner:
    def __init__(self, num_blocks: int, vocab: int, script: Script | None = None,
                 block_size: int = 16, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s  # per forward pass, to give a tick a realistic duration
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab = vocab
        self.script = script or hash_script(vocab)
        self.cache: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.passes: list[list[ScheduledChunk]] = []
        self.copies: list[tuple[int, int]] = []

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        self.passes.append([ScheduledChunk(list(c.token_ids), c.start_pos, list(c.block_table),
                                           c.needs_logits) for c in chunks])
        if self.delay_s:
            time.sleep(self.delay_s)
        bs = self.block_size
        rows = []
        for c in chunks:
            for i, tok in enumerate(c.token_ids):
                pos = c.start_pos + i
                self.cache[c.block_table[pos // bs]][pos % bs] = tok
            ctx = self.context(c)
            end = len(ctx)
            rows += [self.logits(ctx[: end - back]) for back in range(c.num_logit_rows - 1, -1, -1)]
        if not rows:
            return torch.empty(0, self.vocab)
        return torch.stack(rows)

    def context(self, chunk: ScheduledChunk) -> list[int]:
        """Every token up to the chunk's end, read back through its block table."""
        bs = self.block_size
        end = chunk.start_pos + len(chunk.token_ids)
        ctx = [self.cache[chunk.block_table[p // bs]][p % bs] for p in range(end)]
        assert None not in ctx, "a context position was never written"
        return [t for t in ctx if t is not None]

    def logits(self, ctx: list[int]) -> torch.Tensor:
        # The scripted token gets the top logit; the rest a smooth spread, so sampling varies,
        # but never into the special ids (EOS among them): a test that wants EOS scripts it.
        out = torch.linspace(0.0, 2.0, self.vocab)
        out[SPECIAL_IDS:] = float("-inf")
        out[self.script(ctx)] = 4.0
        return out

    def copy_block(self, src: int, dst: int) -> None:
        self.copies.append((src, dst))
        self.cache[dst] = list(self.cache[src])
