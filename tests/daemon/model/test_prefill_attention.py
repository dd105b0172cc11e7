"""Prefill attention over the paged cache (daemon/model/kernels/cpu_prefill.c) against the torch
reference (daemon/model/attention.py's prefill_attention), chunk by chunk."""

from __future__ import annotations

import platform

import pytest
import torch

from daemon.model.attention import PrefillSpan, prefill_attention
from daemon.model.kernels import cpu
from daemon.model.kernels.cpu_modules import CpuPagedAttention
from tests.support.paged_cache import random_cache


@pytest.fixture(scope="module")
def kernels() -> cpu.Kernels:
    lib = cpu.load()
    assert lib is not None, f"the CPU kernels must build here: {cpu.failure()}"
    return lib


def both(lib: cpu.Kernels, tokens: int, past: int, heads: int, kv_heads: int, head_dim: int,
         dtype: torch.dtype = torch.float32, window: int | None = None, block: int = 16,
         scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's and the reference's output for a chunk of `tokens` queries after `past`
    cached tokens, its blocks scattered over the pool."""
    context = past + tokens
    cache, tables, _ = random_cache([context], kv_heads, head_dim, block, dtype)
    ids = tables[0]
    keys = torch.arange(context)
    mask = keys[None] <= torch.arange(past, context)[:, None] if past else None
    span = PrefillSpan(rows=slice(0, tokens), context_len=context, block_ids=ids, mask=mask)
    # The chunk's own keys and values, as the layer hands them over (the reference reads them
    # when nothing precedes the chunk).
    own = [c[ids].transpose(1, 2).flatten(0, 1)[past:context].float() for c in cache]
    q = torch.randn(tokens, heads + 2 * kv_heads, head_dim)[:, :heads]  # as the model's view
    want = prefill_attention(q, *own, cache[0], cache[1], span, scale, window)
    got = CpuPagedAttention(lib, scale, window).prefill(q, *own, cache[0], cache[1], span)
    return got, want


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 1, 64),
                                                             (12, 2, 128), (32, 4, 16)])
@pytest.mark.parametrize(("tokens", "past"), [(1, 0), (5, 0), (47, 0), (130, 0), (1, 30),
                                              (17, 16), (64, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_reads_the_blocks_in_place(kernels: cpu.Kernels, heads: int,
                                                     kv_heads: int, head_dim: int, tokens: int,
                                                     past: int, dtype: torch.dtype) -> None:
    """Every group size's row tiles (full and cut short), chunks with and without a cached
    prefix, keys across block boundaries, float32 and bf16 caches."""
    got, want = both(kernels, tokens, past, heads, kv_heads, head_dim, dtype)
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("window", [1, 7, 16, 40])
@pytest.mark.parametrize(("tokens", "past"), [(50, 0), (20, 100), (1, 60)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_reads_only_the_window(kernels: cpu.Kernels, window: int, tokens: int,
                                                 past: int, dtype: torch.dtype) -> None:
    got, want = both(kernels, tokens, past, 6, 2, 64, dtype, window=window, scale=0.3)
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("block", [8, 32, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_takes_any_block_size(kernels: cpu.Kernels, block: int,
                                                dtype: torch.dtype) -> None:
    """Key tiles stop at block ends: blocks smaller than a tile, and not a multiple of it."""
    got, want = both(kernels, 70, 45, 6, 2, 32, dtype, block=block)
    assert (got - want).abs().max() < 1e-5


def test_prefill_attention_is_exact_on_a_peaked_softmax(kernels: cpu.Kernels) -> None:
    """Scores far apart (a max that moves tile after tile, exps that underflow): the online
    softmax's rescaling, not a tolerance, keeps it equal."""
    got, want = both(kernels, 40, 200, 4, 2, 64, scale=4.0)
    assert (got - want).abs().max() < 1e-4


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 vector widths")
@pytest.mark.parametrize("arch", ["x86-64-v3", "x86-64"])  # AVX2 (8 lanes), SSE2 (4 lanes)
def test_narrower_vector_builds_attend_the_same(arch: str) -> None:
    lib = cpu.Kernels(cpu._build(arch))
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, past, window in ((33, 0, None), (20, 70, None), (40, 30, 25)):
            got, want = both(lib, tokens, past, 9, 3, 64, dtype, window)
            assert (got - want).abs().max() < 1e-5
