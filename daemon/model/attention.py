"""Attention over the paged KV cache: the one boundary every device's kernel sits behind.

Per layer the cache is one tensor ``[2, num_blocks, num_kv_heads, block_size, head_dim]`` (K
then V): one head's keys of one block are a contiguous [block_size, head_dim] tile, so a decode
kernel streams each tile. `AttentionMetadata` is built once per tick by the runner, as tensors
(no host syncs inside the forward): where each new token's K/V goes, and for each decoding
sequence its block table and context length.

`PagedAttention` writes the new K/V into the cache, then attends: decode rows (one query per
sequence, rows [0, num_decode_tokens)) through `decode`, prefill chunks through SDPA, causal
with an offset. `decode` here is the reference: it gathers every sequence's blocks into a
padded tensor, which costs a copy of the whole context per layer per tick. Devices replace it
with a kernel that reads the blocks where they lie: daemon/model/kernels/cpu_modules.py on CPU,
daemon/model/kernels/triton_attention.py on CUDA.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclasses.dataclass(slots=True)
class PrefillSpan:
    rows: slice  # this chunk's rows in the flattened batch
    context_len: int  # tokens in the cache once this chunk is written
    block_ids: Tensor  # long [ceil(context_len / block_size)]
    # [n, context_len] bool, True = visible. None when nothing precedes the chunk in the
    # cache: plain causal attention over the chunk's own K/V, no gather needed.
    mask: Tensor | None


@dataclasses.dataclass(slots=True)
class AttentionMetadata:
    # long [T * KVH]: for each new token and KV head, its row in the cache viewed as
    # [-1, head_dim], that is (block * KVH + head) * block_size + offset.
    write_rows: Tensor
    num_decode_tokens: int  # rows [0, num_decode_tokens) are single-token chunks
    decode_block_tables: Tensor | None  # long [D, max_blocks], padded with any valid id
    decode_context_lens: Tensor | None  # long [D]: cached tokens each decode row attends to
    prefills: list[PrefillSpan]
    # The reference decode's masks by window (None: full), [D, 1, 1, max_blocks * block_size],
    # each made on first use.
    decode_masks: dict[int | None, Tensor] = dataclasses.field(default_factory=dict)


def cache_rows(slots: Tensor, num_kv_heads: int, block_size: int) -> Tensor:
    """Slots (block * block_size + offset) -> `AttentionMetadata.write_rows`, on the slots'
    device."""
    blocks, offsets = slots // block_size, slots % block_size
    heads = torch.arange(num_kv_heads, device=slots.device)
    return ((blocks[:, None] * num_kv_heads + heads) * block_size + offsets[:, None]).flatten()


class PagedAttention(nn.Module):
    """q [T, H, d], k/v [T, KVH, d] -> [T, H, d]; writes k/v into the cache first.

    scale: of the scores, None = 1 / sqrt(d); window: each query sees only the last `window`
    keys, itself included (None: the whole context)."""

    def __init__(self, scale: float | None = None, window: int | None = None) -> None:
        super().__init__()
        self.scale, self.window = scale, window

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata) -> Tensor:
        self.store(k, v, kv_cache, meta)
        return self.attend(q, k, v, kv_cache, meta)

    def store(self, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata) -> None:
        head_dim = kv_cache.shape[-1]
        for new, cache in ((k, kv_cache[0]), (v, kv_cache[1])):
            cache.view(-1, head_dim).index_copy_(0, meta.write_rows,
                                                 new.reshape(-1, head_dim).to(cache.dtype))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor,
               meta: AttentionMetadata) -> Tensor:
        """Attention of q over the cache, which already holds this batch's k and v."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_decode = meta.num_decode_tokens
        if not meta.prefills:
            return self.decode(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        if num_decode:
            out[:num_decode] = self.decode(q[:num_decode], k_cache, v_cache, meta)
        for span in meta.prefills:
            out[span.rows] = self.prefill(q[span.rows], k[span.rows], v[span.rows], k_cache,
                                          v_cache, span)
        return out

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                span: PrefillSpan) -> Tensor:
        """One prefill chunk's attention: q, k, v its rows, the cache holding them already."""
        return prefill_attention(q, k, v, k_cache, v_cache, span, self.scale, self.window)

    def decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor,
               meta: AttentionMetadata) -> Tensor:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads, block_size = k_cache.shape[1:3]
        mask = meta.decode_masks.get(self.window)
        if mask is None:
            keys = torch.arange(meta.decode_block_tables.shape[1] * block_size, device=q.device)
            lens = meta.decode_context_lens[:, None]
            visible = keys[None, :] < lens
            if self.window is not None:
                visible &= keys[None, :] >= lens - self.window
            mask = meta.decode_masks[self.window] = visible[:, None, None, :]
        # [D, blocks, KVH, block_size, d] -> [D, KVH, L, d]
        keys = k_cache[meta.decode_block_tables].transpose(1, 2).flatten(2, 3).to(q.dtype)
        values = v_cache[meta.decode_block_tables].transpose(1, 2).flatten(2, 3).to(q.dtype)
        # One query per sequence, so the query heads sharing a KV head can stand in as that
        # head's query rows: GQA without repeating K/V.
        grouped = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask,
                                             scale=self.scale)
        return out.reshape(num_seqs, num_heads, head_dim)


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                      span: PrefillSpan, scale: float | None = None,
                      window: int | None = None) -> Tensor:
    if window is not None and span.context_len > window:
        return _sliding_prefill(q, k_cache, v_cache, span, scale, window)
    if span.mask is None:
        keys, values = k, v
    else:
        # [blocks, KVH, block_size, d] -> [L, KVH, d]
        keys = k_cache[span.block_ids].transpose(1, 2).flatten(0, 1)[: span.context_len]
        values = v_cache[span.block_ids].transpose(1, 2).flatten(0, 1)[: span.context_len]
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    # 4-D inputs: CPU SDPA only takes its fused (flash) kernel for batched 4-D tensors.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=span.mask, is_causal=span.mask is None, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _sliding_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, span: PrefillSpan,
                     scale: float | None, window: int) -> Tensor:
    """The chunk's queries over the cached keys from the first one its first query sees."""
    n, end, block_size = q.shape[0], span.context_len, k_cache.shape[2]
    lo = max(0, end - n - window + 1)
    skip = lo // block_size  # whole blocks no query of the chunk sees
    seen = slice(lo - skip * block_size, end - skip * block_size)
    # [blocks, KVH, block_size, d] -> [L, KVH, d]
    keys = k_cache[span.block_ids[skip:]].transpose(1, 2).flatten(0, 1)[seen]
    values = v_cache[span.block_ids[skip:]].transpose(1, 2).flatten(0, 1)[seen]
    query_pos = torch.arange(end - n, end, device=q.device)[:, None]
    key_pos = torch.arange(lo, end, device=q.device)[None, :]
    mask = (key_pos <= query_pos) & (key_pos > query_pos - window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.to(q.dtype).transpose(0, 1)[None],
        values.to(q.dtype).transpose(0, 1)[None], attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
