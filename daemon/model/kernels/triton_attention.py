"""Decode attention over the paged KV cache on CUDA, as a Triton kernel.

Imported only when the model runs on CUDA (daemon/model/kernels/__init__.py), so CPU machines never
need Triton. One program per (sequence, KV head, split of the context): it loads the query heads that share
the KV head (padded to tl.dot's 16 rows), walks its part of the sequence's block table
PAGES cache blocks at a time, reads each block's [block_size, head_dim] tile of K and of V
where it lies (cache layout [2, blocks, kv_heads, block_size, head_dim]) and keeps an online
softmax, so nothing is gathered or padded. Splits (flash-decoding) keep the GPU busy when few
sequences decode long contexts; `merge` joins them. Metadata are the runner's tensors (block
tables, context lengths) and the split count comes from their shapes: no host sync.

`reference_decode` is the same walk in torch, index for index; it runs on CPU, so the kernel's
addressing is tested on machines without a GPU (tests/daemon/model/test_triton_attention.py).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
from typing import cast

import torch
from torch import Tensor

from daemon.model.attention import AttentionMetadata, PagedAttention
from daemon.model.decoder import DecoderLayer, DecoderLM


def available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def install_(model: DecoderLM) -> None:
    for layer in model.layers:
        attn = cast(DecoderLayer, layer).attn
        attn.paged = TritonPagedAttention(attn.paged.scale, attn.paged.window)


class TritonPagedAttention(PagedAttention):
    def decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor,
               meta: AttentionMetadata) -> Tensor:
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        assert tables is not None and lens is not None
        return triton_decode(q, k_cache, v_cache, tables, lens, self.scale, self.window)


PAGES = 4  # cache blocks per loop step: more bytes in flight per program
MIN_ROWS = 16  # tl.dot's smallest tile: query heads are padded up to it


def plan(num_seqs: int, num_kv_heads: int, max_blocks: int, block: int,
         num_sms: int) -> tuple[int, int]:
    """(steps of PAGES blocks per split, splits): enough programs to fill the GPU twice over,
    from shapes alone (no host sync; fixed for a captured graph)."""
    steps = -(-max_blocks // PAGES)
    programs = num_seqs * num_kv_heads
    splits = max(1, min(steps, -(-2 * num_sms // programs)))
    per_split = -(-steps // splits)
    return per_split, -(-steps // per_split)


def triton_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor,
                  lens: Tensor, scale: float | None = None,
                  window: int | None = None) -> Tensor:
    """q [D, H, d] (any row stride, unit stride within a row) -> [D, H, d]. scale: of the
    scores (None: 1 / sqrt(d)); window: each query sees only the last `window` keys."""
    import triton

    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    per_split, splits = plan(num_seqs, num_kv_heads, tables.shape[1], block_size,
                             _multiprocessors(q.device))
    rows = max(triton.next_power_of_2(group), MIN_ROWS)
    dim_pad = max(triton.next_power_of_2(head_dim), 16)
    # Per split: running max and sum per query row, and the unnormalised output.
    partial = torch.empty(num_seqs, num_kv_heads, splits, rows, dim_pad + 2, device=q.device,
                          dtype=torch.float32)
    _kernel()[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, tables, lens, partial, q.stride(0), tables.stride(0),
        1.0 / math.sqrt(head_dim) if scale is None else scale, window or 0, num_kv_heads,
        per_split, splits,
        GROUP=group, ROWS=rows, HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK=block_size,
        PAGES=PAGES, IEEE=q.dtype == torch.float32, num_warps=4)
    out = merge(partial)[:, :, :group, :head_dim]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def merge(partial: Tensor) -> Tensor:
    """[D, KVH, splits, rows, d + 2] (acc, max, sum) -> [D, KVH, rows, d]: the splits' softmaxes
    rescaled to one maximum. A split past a sequence's end has max -inf and weighs nothing."""
    acc, mx, total = partial[..., :-2], partial[..., -2], partial[..., -1]
    top = mx.amax(dim=2, keepdim=True)
    weight = torch.exp(mx - top).nan_to_num(0.0)
    out = (acc * weight[..., None]).sum(dim=2)
    return out / (total * weight).sum(dim=2)[..., None]


_compiled = None


def _kernel():  # type: ignore[no-untyped-def]
    """The jitted kernel, defined on first use so that importing this module needs no Triton."""
    global _compiled
    if _compiled is not None:
        return _compiled
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[misc]
    def decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, part_ptr, q_row, table_row,
                      scale, window, num_kv_heads, per_split, splits, GROUP: tl.constexpr,
                      ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                      BLOCK: tl.constexpr, PAGES: tl.constexpr, IEEE: tl.constexpr):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(lens_ptr + seq)
        rows = tl.arange(0, ROWS)
        dims = tl.arange(0, DIM_PAD)
        tokens = tl.arange(0, PAGES * BLOCK)
        row_ok = rows < GROUP
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + seq * q_row + (kv_head * GROUP + rows)[:, None] * HEAD_DIM
                    + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        q = (q.to(tl.float32) * scale).to(k_ptr.dtype.element_ty)
        mx = tl.full([ROWS], float("-inf"), tl.float32)
        total = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, DIM_PAD], tl.float32)
        first = split * per_split * PAGES * BLOCK
        end = tl.minimum(length, first + per_split * PAGES * BLOCK)
        # A sliding window's first key: steps wholly before it are skipped, the rest masked.
        lo = tl.where(window > 0, tl.maximum(length - window, 0), 0)
        begin = tl.maximum(first, lo // (PAGES * BLOCK) * (PAGES * BLOCK))
        for start in range(begin, end, PAGES * BLOCK):
            pos = start + tokens
            tok_ok = (pos < end) & (pos >= lo)
            block = tl.load(tables_ptr + seq * table_row + pos // BLOCK, mask=tok_ok, other=0)
            tile = (block.to(tl.int64) * num_kv_heads + kv_head) * BLOCK + pos % BLOCK
            offs = tile[:, None] * HEAD_DIM + dims[None, :]
            mask = tok_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + offs, mask=mask, other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(tok_ok[None, :], scores, float("-inf"))
            new_mx = tl.maximum(mx, tl.max(scores, axis=1))
            alpha = tl.exp(mx - new_mx)
            p = tl.exp(scores - new_mx[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + offs, mask=mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            mx = new_mx
        base = (((seq * num_kv_heads + kv_head) * splits + split) * ROWS + rows) * (DIM_PAD + 2)
        tl.store(part_ptr + base[:, None] + dims[None, :], acc)
        tl.store(part_ptr + base + DIM_PAD, mx)
        tl.store(part_ptr + base + DIM_PAD + 1, total)

    _compiled = decode_kernel
    return _compiled


def reference_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor,
                     lens: Tensor, num_sms: int = 132, scale: float | None = None,
                     window: int | None = None) -> Tensor:
    """The kernel's walk in torch, program by program, with its flat offsets, masks, splits
    and merge (float32 throughout)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    per_split, splits = plan(num_seqs, num_kv_heads, tables.shape[1], block, num_sms)
    k_flat, v_flat = k_cache.reshape(-1).float(), v_cache.reshape(-1).float()
    tokens, dims = torch.arange(PAGES * block), torch.arange(head_dim)
    partial = torch.empty(num_seqs, num_kv_heads, splits, group, head_dim + 2)
    for seq, kv_head, split in itertools.product(range(num_seqs), range(num_kv_heads),
                                                 range(splits)):
        qh = q[seq, kv_head * group : (kv_head + 1) * group].float()
        qh = qh * (1.0 / math.sqrt(head_dim) if scale is None else scale)
        mx, total = torch.full((group,), float("-inf")), torch.zeros(group)
        acc = torch.zeros(group, head_dim)
        first = split * per_split * PAGES * block
        end = min(int(lens[seq]), first + per_split * PAGES * block)
        lo = max(int(lens[seq]) - window, 0) if window else 0
        begin = max(first, lo // (PAGES * block) * (PAGES * block))
        for start in range(begin, end, PAGES * block):
            pos = start + tokens
            tok_ok = (pos < end) & (pos >= lo)
            ids = tables[seq, (pos // block).clamp(max=tables.shape[1] - 1)]
            tile = (torch.where(tok_ok, ids, 0) * num_kv_heads + kv_head) * block + pos % block
            offs = tile[:, None] * head_dim + dims[None, :]
            k = torch.where(tok_ok[:, None], k_flat[offs], 0.0)
            scores = torch.where(tok_ok[None, :], qh @ k.T, float("-inf"))
            new_mx = torch.maximum(mx, scores.max(dim=1).values)
            alpha = torch.exp(mx - new_mx)
            p = torch.exp(scores - new_mx[:, None])
            total = total * alpha + p.sum(dim=1)
            acc = acc * alpha[:, None] + p @ torch.where(tok_ok[:, None], v_flat[offs], 0.0)
            mx = new_mx
        partial[seq, kv_head, split] = torch.cat([acc, mx[:, None], total[:, None]], dim=1)
    return merge(partial).reshape(num_seqs, num_heads, head_dim).to(q.dtype)
