"""Turns the scheduler's chunks into one forward pass over the paged KV cache.

The runner owns the cache tensors and nothing else: which blocks belong to which sequence
is the scheduler's business, handed over as a block table per chunk.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from daemon.attention import AttentionMetadata, PrefillSpan
from daemon.config import ModelConfig
from daemon.model import DecoderLM
from daemon.scheduler import ScheduledChunk  # the scheduler owns it: it must stay torch-free


@dataclasses.dataclass(slots=True)
class _Batch:
    input_ids: Tensor
    positions: Tensor
    meta: AttentionMetadata
    logit_rows: Tensor


class ModelRunner:
    def __init__(self, model: DecoderLM, config: ModelConfig, num_blocks: int,
                 block_size: int = 16, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = (torch.device(device) if device is not None
                       else model.inv_freq.device)
        self.dtype = dtype if dtype is not None else model.dtype
        # With tensor parallelism this rank's KV heads only (model.num_kv_heads).
        shape = (2, num_blocks, model.num_kv_heads, block_size, config.head_dim)
        self.kv_caches = [torch.zeros(shape, device=self.device, dtype=self.dtype)
                          for _ in range(config.num_layers)]

    @staticmethod
    def blocks_for_budget(config: ModelConfig, budget_bytes: int, dtype: torch.dtype,
                          block_size: int = 16, num_kv_heads: int | None = None) -> int:
        """How many KV blocks (K and V of every layer, of `num_kv_heads`, default all) fit in
        `budget_bytes`."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
        per_block = 2 * config.num_layers * block_size * heads * config.head_dim * itemsize
        return budget_bytes // per_block

    def run(self, chunks: list[ScheduledChunk]) -> Tensor:
        """float32 logits [number of chunks with needs_logits, vocab], in chunk order."""
        with torch.inference_mode():
            if not chunks:
                return torch.empty(0, self.config.vocab_size, device=self.device)
            batch = self._prepare(chunks)
            hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_caches)
            return self.model.compute_logits(hidden[batch.logit_rows])

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: a forked sequence gets its own copy of a shared partial block."""
        with torch.inference_mode():
            for cache in self.kv_caches:
                cache[:, dst].copy_(cache[:, src])

    # ---- batch preparation

    def check(self, chunks: list[ScheduledChunk]) -> None:
        """Raises ValueError naming the first chunk this runner cannot run."""
        for i, chunk in enumerate(chunks):
            self._check(i, chunk)

    def _prepare(self, chunks: list[ScheduledChunk]) -> _Batch:
        self.check(chunks)
        decode_idx = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        prefill_idx = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
        token_ids: list[int] = []
        positions: list[int] = []
        last_row = [0] * len(chunks)
        for i in decode_idx + prefill_idx:
            chunk = chunks[i]
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.start_pos + len(chunk.token_ids)))
            last_row[i] = len(token_ids) - 1
        decode_slots, tables, lens = self._decode_meta([chunks[i] for i in decode_idx])
        prefill_slots, spans = self._prefill_meta([chunks[i] for i in prefill_idx],
                                                  len(decode_idx))
        meta = AttentionMetadata(
            write_rows=self._write_rows(torch.cat([decode_slots, *prefill_slots])),
            num_decode_tokens=len(decode_idx),
            decode_block_tables=tables,
            decode_context_lens=lens,
            prefills=spans,
        )
        rows = [last_row[i] for i, c in enumerate(chunks) if c.needs_logits]
        return _Batch(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            meta=meta,
            logit_rows=torch.tensor(rows, dtype=torch.long, device=self.device),
        )

    def _write_rows(self, slots: Tensor) -> Tensor:
        """Slots (block * block_size + offset) -> cache rows of every KV head, see
        `AttentionMetadata.write_rows`."""
        bs, heads = self.block_size, self.model.num_kv_heads
        blocks, offsets = slots // bs, slots % bs
        rows = (blocks[:, None] * heads + torch.arange(heads)) * bs + offsets[:, None]
        return rows.flatten().to(self.device)

    def _check(self, index: int, chunk: ScheduledChunk) -> None:
        end = chunk.start_pos + len(chunk.token_ids)
        if not chunk.token_ids:
            raise ValueError(f"chunk {index}: token_ids is empty")
        if chunk.start_pos < 0:
            raise ValueError(f"chunk {index}: start_pos must be >= 0, got {chunk.start_pos}")
        if len(chunk.block_table) * self.block_size < end:
            raise ValueError(f"chunk {index}: block_table has {len(chunk.block_table)} blocks, "
                             f"too few for {end} positions of {self.block_size}")
        if any(not 0 <= b < self.num_blocks for b in chunk.block_table):
            raise ValueError(f"chunk {index}: block_table holds an id outside "
                             f"0..{self.num_blocks - 1}")
        if end > self.config.max_position_embeddings:
            raise ValueError(f"chunk {index}: position {end - 1} exceeds max_position_embeddings "
                             f"{self.config.max_position_embeddings}")

    def _decode_meta(self, chunks: list[ScheduledChunk]
                     ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        if not chunks:
            return torch.empty(0, dtype=torch.long), None, None
        bs = self.block_size
        slots = [c.block_table[c.start_pos // bs] * bs + c.start_pos % bs for c in chunks]
        context_lens = [c.start_pos + 1 for c in chunks]
        max_blocks = (max(context_lens) + bs - 1) // bs
        # Padding points at block 0; attention stops at each context length.
        tables = [c.block_table[:max_blocks] + [0] * (max_blocks - len(c.block_table))
                  for c in chunks]
        return (torch.tensor(slots, dtype=torch.long),
                torch.tensor(tables, dtype=torch.long, device=self.device),
                torch.tensor(context_lens, dtype=torch.long, device=self.device))

    def _prefill_meta(self, chunks: list[ScheduledChunk], first_row: int
                      ) -> tuple[list[Tensor], list[PrefillSpan]]:
        bs = self.block_size
        slots: list[Tensor] = []
        spans: list[PrefillSpan] = []
        row = first_row
        for c in chunks:
            n = len(c.token_ids)
            context_len = c.start_pos + n
            block_ids = torch.tensor(c.block_table[: (context_len + bs - 1) // bs],
                                     dtype=torch.long)
            pos = torch.arange(c.start_pos, context_len)
            slots.append(block_ids[pos // bs] * bs + pos % bs)
            mask = None
            if c.start_pos:
                keys = torch.arange(context_len, device=self.device)
                mask = keys[None, :] <= pos.to(self.device)[:, None]
            spans.append(PrefillSpan(rows=slice(row, row + n), context_len=context_len,
                                     block_ids=block_ids.to(self.device), mask=mask))
            row += n
        return slots, spans
