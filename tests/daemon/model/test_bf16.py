"""bfloat16 weights with bfloat16 products (daemon/model/kernels/bf16*.c): each tier this CPU
runs (AMX where it has the tiles, AVX512_BF16, or none: float32 FMAs at every row count)
against a plain reference, and the row counts that keep float32 activations."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from daemon.model.kernels import cpu
from daemon.model.kernels.cpu_modules import PackedLinear

TIERS = ["none", "avx512-bf16", "amx-bf16"]  # bf16.c's order
BF16_ROWS = 4  # bf16.c: calls of this many rows and more take the bf16 products


@pytest.fixture(scope="module")
def kernels() -> cpu.Kernels:
    lib = cpu.load()
    assert lib is not None, f"the CPU kernels must build here: {cpu.failure()}"
    return lib


@pytest.fixture(params=range(len(TIERS)), ids=TIERS)
def tier(request: pytest.FixtureRequest, kernels: cpu.Kernels) -> Iterator[int]:
    if kernels.bf16_select(request.param) != request.param:
        kernels.bf16_select(-1)
        pytest.skip(f"this CPU (or its kernel) gives no {TIERS[request.param]}")
    yield request.param
    kernels.bf16_select(-1)


def rounded(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


@pytest.mark.parametrize(("n", "k", "gated"), [(70, 33, False), (96, 577, False), (80, 64, True)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 12, 13, 40, 130])
def test_each_tier_multiplies_bf16_weights_by_bf16_activations(
        kernels: cpu.Kernels, tier: int, n: int, k: int, gated: bool, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    bias = None if gated else torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    layer = PackedLinear(w, bias, kernels, gate_up=gated)
    # At BF16_ROWS rows and more the tiers round the activations to bf16; fewer keep float32.
    xs = rounded(x) if tier and rows >= BF16_ROWS else x
    want = F.linear(xs.double(), w.double(), None if bias is None else bias.double())
    if gated:
        gate, up = want.chunk(2, dim=-1)
        want = F.silu(gate) * up
    assert (layer(x).double() - want).abs().max() < 1e-5 * want.abs().max()


def test_a_chunk_of_drafts_keeps_the_path_of_its_one_row(kernels: cpu.Kernels) -> None:
    """A verify step's rows count as its sequences (quant_set_step_rows): one sequence's 1 + k
    rows keep float32 activations, as its one-row decode does, so drafts change no bit."""
    w = (torch.randn(64, 96) * 0.05).bfloat16()
    layer, x = PackedLinear(w, None, kernels), torch.randn(6, 96)
    one_at_a_time = torch.cat([layer(x[i : i + 1]) for i in range(6)])
    kernels.quant_set_step_rows(1)
    try:
        assert torch.equal(layer(x), one_at_a_time)
    finally:
        kernels.quant_set_step_rows(0)


@pytest.mark.parametrize("k", [33, 64, 577])
def test_packed_rows_read_back_as_the_weight(kernels: cpu.Kernels, k: int) -> None:
    """A tied head's packed bf16 pairs serve the embedding lookups: rows come back exact."""
    w = torch.randn(70, k).bfloat16()
    ids = torch.tensor([0, 5, 31, 32, 69])
    assert torch.equal(PackedLinear(w, None, kernels).rows(ids), w[ids].float())
