"""Decode-only ticks through fixed-shape buffers, replayed as CUDA graphs on CUDA.

A tick whose chunks are all single tokens runs here when it fits the largest bucket: it is
padded up to the smallest bucket (1, 2, 4, ... up to the runner's --max-num-seqs) that holds
it, so that every tensor of the forward pass has that bucket's fixed shape. On CUDA each
bucket's forward pass is captured once as a graph and replayed: one launch instead of a few
hundred, and the Triton kernel's split count is fixed by the bucket's shapes. Elsewhere the
same buffers and the same forward run eagerly, which is how CPU tests prove the padding.

Per tick the host copies one int64 tensor into `staging`, laid out for bucket b as
``[token ids (b) | context lengths (b) | the context's block ids, row after row]``; the
block tables ``[b, width]``, positions and cache slots are derived from it inside the graph.
Padding rows decode token 0 at position 0 of the scratch block (the cache's last block, which
the block manager never hands out), so they never write a real block's KV.
"""

from __future__ import annotations

import torch
from torch import Tensor

from daemon.model.attention import AttentionMetadata, cache_rows
from daemon.model.batch import ScheduledChunk
from daemon.model.decoder import DecoderLM


def buckets_for(max_batch: int) -> list[int]:
    """Powers of two below `max_batch`, then `max_batch` itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


class DecodeGraphs:
    """kv_caches: the runner's, whose last block is `scratch`; width: block-table columns
    (enough for the longest context)."""

    def __init__(self, model: DecoderLM, kv_caches: list[Tensor], block_size: int,
                 width: int, max_batch: int, num_kv_heads: int) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.width, self.num_kv_heads = block_size, width, num_kv_heads
        self.scratch = kv_caches[0].shape[1] - 1
        self.buckets = buckets_for(max_batch)
        self.device = kv_caches[0].device
        self.staging = torch.zeros(max_batch * (2 + width), dtype=torch.long,
                                   device=self.device)
        self.columns = torch.arange(width, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}

    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        return len(chunks) <= self.buckets[-1] and all(
            len(c.token_ids) == 1 and not c.all_logits for c in chunks)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, chunks: list[ScheduledChunk]) -> Tensor:
        """float32 logits of the chunks that need them, in order. On CUDA a view of the
        graph's output: valid until the next call."""
        b = self.bucket(len(chunks))
        self._load(chunks, b)
        graph = self.graphs.get(b)
        if graph is None:
            logits = self._forward(b)
        else:
            graph.replay()
            logits = self.outputs[b]
        rows = [i for i, c in enumerate(chunks) if c.needs_logits]
        if len(rows) == len(chunks):
            return logits[: len(chunks)]
        return logits[torch.tensor(rows, device=logits.device)]

    def capture(self) -> None:
        """One graph per bucket, largest first, sharing one memory pool (they never run at
        once). Each forward runs once eagerly before its capture: Triton compiles there."""
        pool = None
        side = torch.cuda.Stream(self.device)
        with torch.inference_mode():
            for b in reversed(self.buckets):
                self._load([], b)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    self._forward(b)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[b] = self._forward(b)
                pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.synchronize(self.device)

    # ---- the tick's inputs and the bucket's forward pass

    def _load(self, chunks: list[ScheduledChunk], b: int) -> None:
        bs, pad = self.block_size, b - len(chunks)
        ids = [c.token_ids[0] for c in chunks]
        lens = [c.start_pos + 1 for c in chunks]
        blocks: list[int] = []
        for c, n in zip(chunks, lens, strict=True):
            blocks += c.block_table[: (n + bs - 1) // bs]
        values = torch.tensor([*ids, *[0] * pad, *lens, *[1] * pad, *blocks,
                               *[self.scratch] * pad], dtype=torch.long)
        if self.device.type == "cuda":
            values = values.pin_memory()
        self.staging[: values.numel()].copy_(values, non_blocking=True)

    def _forward(self, b: int) -> Tensor:
        bs, width = self.block_size, self.width
        ids, lens = self.staging[:b], self.staging[b : 2 * b]
        flat = self.staging[2 * b : b * (2 + width)]
        num_blocks = (lens + bs - 1) // bs
        starts = torch.cumsum(num_blocks, 0) - num_blocks
        index = (starts[:, None] + self.columns[None, :]).clamp_(max=flat.numel() - 1)
        used = self.columns[None, :] < num_blocks[:, None]
        tables = torch.where(used, flat[index], self.scratch)
        positions = lens - 1
        slots = (tables.gather(1, (positions // bs)[:, None]).squeeze(1) * bs
                 + positions % bs)
        meta = AttentionMetadata(
            write_rows=cache_rows(slots, self.num_kv_heads, bs), num_decode_tokens=b,
            decode_block_tables=tables, decode_context_lens=lens, prefills=[])
        hidden = self.model(ids, positions, meta, self.kv_caches)
        return self.model.compute_logits(hidden)
