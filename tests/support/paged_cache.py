"""A paged KV cache filled at random, for the attention kernels' tests."""

from __future__ import annotations

import torch


def random_cache(lens: list[int], kv_heads: int, head_dim: int, block: int = 16,
                 dtype: torch.dtype = torch.float32, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cache [2, blocks, KVH, block, d], block tables [D, max_blocks], lens [D]); each
    sequence's blocks scattered over the pool, tables padded with block 0."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block) for n in lens]
    num_blocks = sum(per_seq) + 3
    cache = torch.randn(2, num_blocks, kv_heads, block, head_dim, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(per_seq)
    tables = [[ids.pop() for _ in range(n)] + [0] * (width - n) for n in per_seq]
    return cache, torch.tensor(tables), torch.tensor(lens)
