"""Quantized weights on the CPU kernels (daemon/model/kernels/quant*.c, quant_pack.py): GGUF's
blocks decoded exactly, and every kernel tier this CPU can run (the lower ones forced) against
a plain reference of the arithmetic quant.h documents."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from daemon.model.kernels import cpu, quant_pack
from daemon.model.kernels.cpu_modules import PackedLinear
from daemon.model.kernels.quant_pack import Blocks
from tests.support.gguf_files import _encode

Q = gguf.GGMLQuantizationType
TIERS = ["generic", "avx2", "avx-vnni", "avx512-vnni"]  # quant.c's order
KINDS = {Q.Q4_1: quant_pack.TL_Q4, Q.Q8_0: quant_pack.TL_Q8, Q.Q6_K: quant_pack.TL_Q8_16}


@pytest.fixture(scope="module")
def kernels() -> cpu.Kernels:
    lib = cpu.load()
    assert lib is not None, f"the CPU kernels must build here: {cpu.failure()}"
    return lib


def _available(lib: cpu.Kernels) -> list[int]:
    best = lib.quant_select(-1)
    return [t for t in range(len(TIERS)) if t <= best and lib.quant_select(t) == t]


@pytest.fixture(params=range(len(TIERS)), ids=TIERS)
def tier(request: pytest.FixtureRequest, kernels: cpu.Kernels) -> Iterator[int]:
    """Each tier in turn, forced; the best one again afterwards."""
    if request.param not in _available(kernels):
        kernels.quant_select(-1)
        pytest.skip(f"this CPU has no {TIERS[request.param]}")
    kernels.quant_select(request.param)
    yield request.param
    kernels.quant_select(-1)


def blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> Blocks:
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    return quant_pack.from_gguf(_encode(values, qtype, rng), qtype, rows)


@pytest.mark.parametrize("qtype", quant_pack.QUANTIZED_TYPES, ids=lambda q: q.name)
def test_gguf_blocks_decode_to_what_the_file_dequantizes_to(qtype: Q) -> None:
    rng = np.random.default_rng(1)
    values = (rng.standard_normal((48, 512)) * 0.05).astype(np.float32)
    raw = _encode(values, qtype, rng)
    b = quant_pack.from_gguf(raw, qtype, 48)
    assert b.codes.dtype == np.uint8 and b.bs in (16, 32)
    assert b.codes.max() < (16 if b.bits == 4 else 256)
    exact = gguf.quants.dequantize(raw, qtype)
    if qtype in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):  # d x sub-block scale, as float16
        bound = np.abs(exact).reshape(48, -1, b.bs).max(-1, keepdims=True) * 2.0**-10
        assert (np.abs(b.dequantized() - exact).reshape(48, -1, b.bs) <= bound).all()
    else:
        np.testing.assert_array_equal(b.dequantized(), exact)


def test_parts_of_other_types_join_in_the_finest_blocks_and_widest_codes() -> None:
    q, v = blocks(Q.Q4_K, 32, 256), blocks(Q.Q6_K, 16, 256)
    joined = quant_pack.concat([q, v])
    assert (joined.bs, joined.bits, joined.kind) == (16, 8, quant_pack.TL_Q8_16)
    np.testing.assert_array_equal(joined.dequantized(),
                                  np.concatenate([q.dequantized(), v.dequantized()]))


def reference(x: torch.Tensor, b: Blocks, two: bool) -> torch.Tensor:
    """quant.h's arithmetic in float64: activations quantized per block (in one or two terms),
    integer sums of codes times them, then d dx sum + m s."""
    xs = x.numpy().astype(np.float32).reshape(x.shape[0], -1, b.bs)
    amax = np.abs(xs).max(-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(xs * inv)
    if two:
        q2 = np.rint(np.clip((xs - d * q) * inv * np.float32(256), -127, 127))
        q, d = 256 * q + q2, d / 256
    sums = np.einsum("mbi,nbi->mnb", q.astype(np.float64),
                     b.codes.reshape(b.codes.shape[0], -1, b.bs).astype(np.float64))
    s = d[..., 0] * q.sum(-1)  # [m, blocks]
    y = (sums * b.d[None] * d[:, None, :, 0] + b.m[None] * s[:, None, :]).sum(-1)
    return torch.from_numpy(y).float()


@pytest.mark.parametrize("qtype", list(KINDS), ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17, 64])
def test_every_tier_computes_the_documented_sums(kernels: cpu.Kernels, tier: int, qtype: Q,
                                                 rows: int) -> None:
    b = blocks(qtype, 70, 512)  # 70 rows: a part-filled unit and group
    layer = PackedLinear(b, None, kernels, False)
    assert layer.desc.type == KINDS[qtype]
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    got, exact = layer(x), F.linear(x, torch.from_numpy(b.dequantized()))
    scale = exact.abs().max()
    if tier == 0:  # the generic tier dequantizes to float32 and runs the float32 walk
        assert (got - exact).abs().max() < 1e-5 * scale
        return
    assert (got - reference(x, b, two=rows <= 2)).abs().max() < 2e-5 * scale
    assert (got - exact).abs().max() < (1e-4 if rows <= 2 else 2e-2) * scale


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_gated_biased_and_scaled_outputs(kernels: cpu.Kernels, tier: int, rows: int) -> None:
    b = blocks(Q.Q4_0, 2 * 40, 256)  # gate and up of 40 each: 3 half-filled units
    w = torch.from_numpy(b.dequantized())
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(0))
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    gated, out = (PackedLinear(b, None, kernels, gate_up=True),
                  PackedLinear(b, bias := torch.randn(80), kernels, out_scale=0.5))
    for layer in (gated, out):
        layer.desc.two_term_rows = 64  # near float32 sums, so the tolerances can be tight
    assert gated(x).shape == (rows, 40)
    assert torch.allclose(gated(x), F.silu(gate) * up, atol=1e-4)
    assert torch.allclose(out(x), (F.linear(x, w) + bias) * 0.5, atol=1e-4)


@pytest.mark.parametrize("rows", [3, 8, 64, 512])
def test_int8_weights_take_two_term_activations_at_every_row_count(kernels: cpu.Kernels,
                                                                   tier: int, rows: int) -> None:
    """--quantization int8 weights: one-term activations (8 bits) past two rows would throw
    away what their 8-bit codes hold (~1e-2 of the largest sum); two terms stay within 1e-4
    of float32 on the same weights at prefill's row counts too."""
    w = torch.randn(64, 576, generator=torch.Generator().manual_seed(7)) * 0.05
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    got = PackedLinear(w, None, kernels, "int8")(x)
    exact = F.linear(x, torch.from_numpy(quant_pack.quantize(w, 8).dequantized()))
    assert (got - exact).abs().max() < 1e-4 * exact.abs().max()


def test_many_rows_may_take_the_dequantizing_walk(kernels: cpu.Kernels, tier: int) -> None:
    b = blocks(Q.Q5_K, 96, 256)
    layer = PackedLinear(b, None, kernels, False)
    x = torch.randn(33, 256)
    try:
        kernels.quant_set_dequant_rows(16)
        walked = layer(x)
    finally:
        kernels.quant_set_dequant_rows(2**62)
    exact = F.linear(x, torch.from_numpy(b.dequantized()))
    assert (walked - exact).abs().max() < 1e-5 * exact.abs().max()


def test_rows_of_a_quantized_table_are_its_dequantized_rows(kernels: cpu.Kernels) -> None:
    b = blocks(Q.Q8_0, 300, 64)
    ids = torch.tensor([0, 17, 299, 17])
    np.testing.assert_allclose(PackedLinear(b, None, kernels, False).rows(ids).numpy(),
                               b.dequantized()[ids.numpy()], rtol=1e-6)


def test_the_best_tier_is_chosen_by_cpuid(kernels: cpu.Kernels) -> None:
    flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split()) if Path("/proc/cpuinfo").exists() else set()
    want = ("avx512-vnni" if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags
            else "avx-vnni" if {"avx2", "avx_vnni"} <= flags
            else "avx2" if {"avx2", "fma"} <= flags else "generic")
    assert kernels.quant_tier_name(kernels.quant_select(-1)).decode() == want
    assert kernels.quant_select(len(TIERS)) == -1  # no such tier: nothing changes


def test_scales_out_of_float16_range_are_refused() -> None:
    b = blocks(Q.Q8_0, 32, 32)
    b.d[0, 0] = 1e6
    with pytest.raises(ValueError, match="float16"):
        quant_pack.pack(b)
