"""Turns the scheduler's chunks into one forward pass over the paged KV cache.

The runner owns the cache tensors and nothing else: which blocks belong to which sequence
is the scheduler's business, handed over as a block table per chunk. A tick's metadata
(token ids, positions, cache slots, block tables, context lengths) are built on the host as
one int64 tensor and cross to the device in one copy. With `graph_max_batch`, decode-only
ticks run through the fixed-shape buffers of daemon/model/decode_graphs.py (CUDA graphs on CUDA).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from daemon.model.attention import AttentionMetadata, PrefillSpan
from daemon.model.batch import ScheduledChunk
from daemon.model.config import ModelConfig
from daemon.model.decode_graphs import DecodeGraphs
from daemon.model.decoder import DecoderLM
from daemon.model.device import keep_heap


@dataclasses.dataclass(slots=True)
class _Batch:
    input_ids: Tensor
    positions: Tensor
    meta: AttentionMetadata
    logit_rows: Tensor | None  # None: every row, in order (a batch of decodes)


class _Cursor:
    """Consecutive slices of the tick's one metadata tensor."""

    def __init__(self, values: Tensor) -> None:
        self.values, self.at = values, 0

    def take(self, n: int) -> Tensor:
        self.at += n
        return self.values[self.at - n : self.at]


class ModelRunner:
    """graph_max_batch: when > 0, decode-only ticks of up to that many sequences run through
    fixed-shape buffers padded to a bucket (DecodeGraphs), captured as CUDA graphs on CUDA
    (`capture`); the cache then has one more block, the padding rows' scratch block."""

    def __init__(self, model: DecoderLM, config: ModelConfig, num_blocks: int,
                 block_size: int = 16, device: torch.device | None = None,
                 dtype: torch.dtype | None = None, graph_max_batch: int = 0) -> None:
        keep_heap()  # a process-wide setting; the runner is what makes a tick's temporaries
        self.model = model
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = (torch.device(device) if device is not None
                       else model.inv_freq.device)
        self.dtype = dtype if dtype is not None else model.dtype
        # With tensor parallelism this rank's KV heads only (model.num_kv_heads).
        shape = (2, num_blocks + (graph_max_batch > 0), model.num_kv_heads, block_size,
                 config.head_dim)
        self.kv_caches = [torch.zeros(shape, device=self.device, dtype=self.dtype)
                          for _ in range(config.num_layers)]
        self.graphs: DecodeGraphs | None = None
        if graph_max_batch > 0:
            width = -(-config.max_position_embeddings // block_size)
            self.graphs = DecodeGraphs(model, self.kv_caches, block_size, width,
                                       graph_max_batch, model.num_kv_heads)
        self.num_static_ticks = 0  # ticks run through the padded buckets (graphs on CUDA)
        self.num_eager_ticks = 0

    def capture(self) -> None:
        """Capture the decode buckets as CUDA graphs (CUDA only; needs graph_max_batch)."""
        if self.graphs is None or self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device and graph_max_batch > 0")
        self.graphs.capture()

    @staticmethod
    def block_bytes(config: ModelConfig, dtype: torch.dtype, block_size: int = 16,
                    num_kv_heads: int | None = None) -> int:
        """Bytes of one KV block: K and V of every layer, of `num_kv_heads` (default all)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
        return 2 * config.num_layers * block_size * heads * config.head_dim * itemsize

    @staticmethod
    def blocks_for_budget(config: ModelConfig, budget_bytes: int, dtype: torch.dtype,
                          block_size: int = 16, num_kv_heads: int | None = None) -> int:
        """How many KV blocks fit in `budget_bytes`."""
        return budget_bytes // ModelRunner.block_bytes(config, dtype, block_size, num_kv_heads)

    def run(self, chunks: list[ScheduledChunk]) -> Tensor:
        """float32 logits [rows, vocab]: per chunk in order, its last token's row when it
        needs_logits, or one per token with all_logits (a decode bucket's are valid until the
        next call)."""
        with torch.inference_mode():
            if not chunks:
                return torch.empty(0, self.config.vocab_size, device=self.device)
            rows = as_decodes(chunks)
            if self.graphs is not None and self.graphs.fits(rows):
                self.check(rows)
                self.num_static_ticks += 1
                return self.graphs.run(rows)
            self.num_eager_ticks += 1
            batch = self._prepare(rows)
            count = self.model.count_rows_as if rows is not chunks else None
            if count is not None:  # a chunk of drafts counts as the one row it stands for
                count(len(rows) - sum(len(c.token_ids) - 1 for c in chunks if c.drafted))
            try:
                hidden = self.model(batch.input_ids, batch.positions, batch.meta,
                                    self.kv_caches)
                rows_out = hidden if batch.logit_rows is None else hidden[batch.logit_rows]
                return self.model.compute_logits(rows_out)
            finally:
                if count is not None:
                    count(None)

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
        bs = self.block_size
        decode = [c for c in chunks if len(c.token_ids) == 1]
        prefill = [c for c in chunks if len(c.token_ids) > 1]
        token_ids: list[int] = []
        positions: list[int] = []
        # AttentionMetadata.write_rows, made here: six tensor ops were half of a one-stream
        # tick's preparation, and a tick runs them with caches the weights have just flushed.
        head_rows = [h * bs for h in range(self.model.num_kv_heads)]
        write_rows: list[int] = []
        first_row: dict[int, int] = {}
        for chunk in decode + prefill:
            span = range(chunk.start_pos, chunk.start_pos + len(chunk.token_ids))
            table = chunk.block_table
            first_row[id(chunk)] = len(token_ids)
            token_ids += chunk.token_ids
            positions += span
            for p in span:
                base = table[p // bs] * len(head_rows) * bs + p % bs
                write_rows += [base + h for h in head_rows]
        # The last token's row, or every token's for a chunk with all_logits.
        rows = [first_row[id(c)] + len(c.token_ids) - c.num_logit_rows + i
                for c in chunks for i in range(c.num_logit_rows)]
        lens = [c.start_pos + 1 for c in decode]
        width = -(-max(lens) // bs) if decode else 0
        # Padding points at block 0; attention stops at each context length.
        tables = [x for c in decode for x in c.block_table[:width]
                  + [0] * (width - len(c.block_table))]
        spans = [c.block_table[: -(-(c.start_pos + len(c.token_ids)) // bs)] for c in prefill]
        host = torch.tensor([*token_ids, *positions, *write_rows, *rows, *lens, *tables,
                             *(x for s in spans for x in s)], dtype=torch.long)
        if self.device.type == "cuda":
            host = host.pin_memory()
        cursor = _Cursor(host.to(self.device, non_blocking=True))
        num = len(token_ids)
        input_ids, pos, write_t, logit_rows = (cursor.take(num), cursor.take(num),
                                               cursor.take(len(write_rows)), cursor.take(len(rows)))
        lens_t, tables_t = cursor.take(len(lens)), cursor.take(len(tables))
        meta = AttentionMetadata(
            write_rows=write_t,
            num_decode_tokens=len(decode),
            decode_block_tables=tables_t.view(len(decode), width) if decode else None,
            decode_context_lens=lens_t if decode else None,
            prefills=self._spans(prefill, spans, cursor, pos, len(decode)),
        )
        every = rows == list(range(num))  # then no gather: a copy with a cold cache
        return _Batch(input_ids=input_ids, positions=pos, meta=meta,
                      logit_rows=None if every else logit_rows)

    def _spans(self, chunks: list[ScheduledChunk], blocks: list[list[int]], cursor: _Cursor,
               positions: Tensor, first_row: int) -> list[PrefillSpan]:
        spans: list[PrefillSpan] = []
        row = first_row
        for c, ids in zip(chunks, blocks, strict=True):
            n = len(c.token_ids)
            context_len = c.start_pos + n
            mask = None
            if c.start_pos:
                keys = torch.arange(context_len, device=self.device)
                mask = keys[None, :] <= positions[row : row + n, None]
            spans.append(PrefillSpan(rows=slice(row, row + n), context_len=context_len,
                                     block_ids=cursor.take(len(ids)), mask=mask))
            row += n
        return spans

    def _check(self, index: int, chunk: ScheduledChunk) -> None:
        end = chunk.start_pos + len(chunk.token_ids)
        if not chunk.token_ids:
            raise ValueError(f"chunk {index}: token_ids is empty")
        if chunk.start_pos < 0:
            raise ValueError(f"chunk {index}: start_pos must be >= 0, got {chunk.start_pos}")
        if len(chunk.block_table) * self.block_size < end:
            raise ValueError(f"chunk {index}: block_table has {len(chunk.block_table)} blocks, "
                             f"too few for {end} positions of {self.block_size}")
        table = chunk.block_table
        if table and (min(table) < 0 or max(table) >= self.num_blocks):
            raise ValueError(f"chunk {index}: block_table holds an id outside "
                             f"0..{self.num_blocks - 1}")
        if end > self.config.max_position_embeddings:
            raise ValueError(f"chunk {index}: position {end - 1} exceeds max_position_embeddings "
                             f"{self.config.max_position_embeddings}")


def as_decodes(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """Drafted chunks as one-token decodes at consecutive positions, the rest as they are: the
    same rows of logits, in the same order. Each layer writes every row's K and V to the cache
    before any row attends, so a row sees the rows before it; and a step with drafts keeps the
    decode path (the compiled layer on CPU, the CUDA graphs) for its whole batch, where a
    prefill span would send every row through the general one."""
    if not any([c.drafted for c in chunks]):
        return chunks
    out: list[ScheduledChunk] = []
    for c in chunks:
        if c.drafted:
            out += [ScheduledChunk([token], c.start_pos + j, c.block_table, True)
                    for j, token in enumerate(c.token_ids)]
        else:
            out.append(c)
    return out
