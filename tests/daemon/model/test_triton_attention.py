"""The CUDA decode kernel's walk over the paged cache: its addressing checked on CPU through
`reference_decode`, the Triton kernel itself where a GPU is present."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from daemon.model.attention import AttentionMetadata, PagedAttention
from daemon.model.kernels import triton_attention
from daemon.model.kernels.triton_attention import reference_decode
from daemon.model.loader import load_model
from daemon.model.runner import ModelRunner, ScheduledChunk
from tests.support.paged_cache import random_cache

cuda = pytest.mark.skipif(not triton_attention.available(), reason="needs CUDA and Triton")


def reference(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor,
              lens: torch.Tensor, scale: float | None = None,
              window: int | None = None) -> torch.Tensor:
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), q.shape[0], tables, lens, [])
    return PagedAttention(scale, window).decode(q, cache[0], cache[1], meta)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 64), (9, 3, 64), (4, 4, 32),
                                                             (8, 1, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_walk_matches_the_gathering_decode(heads: int, kv_heads: int, head_dim: int,
                                                     dtype: torch.dtype) -> None:
    lens = [1, 15, 16, 17, 40, 300]  # inside, at and across block boundaries
    cache, tables, lens_t = random_cache(lens, kv_heads, head_dim, dtype=dtype)
    q = torch.randn(len(lens), heads, head_dim)
    # As on a 64-SM GPU: the 300-token context is cut into splits that are merged after.
    assert triton_attention.plan(len(lens), kv_heads, tables.shape[1], 16, 64)[1] > 1
    ours = reference_decode(q, cache[0], cache[1], tables, lens_t, num_sms=64)
    assert (ours - reference(q, cache, tables, lens_t)).abs().max() < 1e-5


@pytest.mark.parametrize("window", [1, 16, 70, 100])
def test_reference_walk_reads_only_the_window(window: int) -> None:
    """A sliding window starts the walk at the step holding its first key: splits wholly
    before it do nothing (the merge weighs them 0), the rest mask the keys before it."""
    lens = [1, 15, 16, 17, 40, 300]
    cache, tables, lens_t = random_cache(lens, 2, 64)
    q = torch.randn(len(lens), 4, 64)
    ours = reference_decode(q, cache[0], cache[1], tables, lens_t, num_sms=64, scale=0.2,
                            window=window)
    assert (ours - reference(q, cache, tables, lens_t, 0.2, window)).abs().max() < 1e-5


@cuda
@pytest.mark.parametrize("window", [None, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_the_reference(dtype: torch.dtype, window: int | None) -> None:
    rng = random.Random(0)
    lens = [rng.randint(1, 300) for _ in range(37)] + [1, 16, 2048]
    cache, tables, lens_t = random_cache(lens, 2, 64, dtype=dtype)
    q = torch.randn(len(lens), 6, 64).to(dtype)
    want = reference(q.float(), cache.float(), tables, lens_t, 0.2, window)
    got = triton_attention.triton_decode(q.cuda(), cache[0].cuda(), cache[1].cuda(),
                                         tables.cuda(), lens_t.cuda(), 0.2, window)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got.float().cpu() - want).abs().max() < tol


@cuda
def test_model_on_cuda_decodes_like_transformers(
        llama_checkpoint: Callable[..., tuple[Path, Any]]) -> None:
    path, hf = llama_checkpoint("llama3", False)
    loaded = load_model(str(path), "cuda", torch.float32)
    assert loaded.kernels == "triton"
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=64)
    rng = random.Random(1)
    seqs = [[rng.randrange(2, 300) for _ in range(n)] for n in (3, 17, 40)]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    logits = runner.run([ScheduledChunk(s, 0, t, True) for s, t in zip(seqs, tables,
                                                                         strict=True)])
    for _ in range(5):
        for s, row in zip(seqs, logits.argmax(-1).tolist(), strict=True):
            s.append(row)
        logits = runner.run([ScheduledChunk(s[-1:], len(s) - 1, t, True)
                             for s, t in zip(seqs, tables, strict=True)])
    for s, row in zip(seqs, logits.cpu(), strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([s])).logits[0, -1].float()
        assert (row - want).abs().max() < 1e-3
