"""The CPU kernels (daemon/model/kernels/cpu_kernels.c) against torch, shape by shape."""

from __future__ import annotations

import math
import platform
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from daemon.model.attention import AttentionMetadata, PagedAttention
from daemon.model.config import ModelConfig
from daemon.model.decoder import ACTIVATIONS, DecoderLM, RMSNorm
from daemon.model.kernels import cpu, cpu_modules, quant_pack
from daemon.model.kernels.cpu_modules import CpuDecoderLayer, CpuPagedAttention, KernelRMSNorm, PackedLinear
from daemon.model.loader import init_random_
from daemon.model.runner import ModelRunner, ScheduledChunk
from tests.support.paged_cache import random_cache


@pytest.fixture(scope="module")
def kernels() -> cpu.Kernels:
    lib = cpu.load()
    assert lib is not None, f"the CPU kernels must build here: {cpu.failure()}"
    return lib


def weights(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize(("n_out", "n_in"), [(96, 64), (70, 33), (1, 7), (300, 576)])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_linear_matches_torch(kernels: cpu.Kernels, n_out: int, n_in: int, rows: int) -> None:
    w, b = weights(n_out, n_in), torch.randn(n_out)
    x = torch.randn(rows, n_in)
    layer = PackedLinear(w, b, kernels)
    assert layer.packed.shape == (-(-n_out // 32), n_in, 32)
    assert torch.allclose(layer(x), F.linear(x, w, b), atol=1e-5)


@pytest.mark.parametrize("rows", [*range(1, 18), 63, 64, 65, 130])
def test_every_row_count_matches_torch(kernels: cpu.Kernels, rows: int) -> None:
    """Each tile shape and row split (whole blocks; 3- and 6-row tiles chunk by chunk, up to
    16 rows; 6-row half blocks over all of K), K across chunk boundaries (300 = 2 x 128 + 44),
    every weight type and the gated output."""
    w, b, x = weights(70, 300), torch.randn(70), torch.randn(rows, 300)
    assert torch.allclose(PackedLinear(w, b, kernels)(x), F.linear(x, w, b),
                          atol=1e-5)
    bf16 = w.bfloat16()
    kernels.bf16_select(0)  # the float32 walk at every row count (test_bf16.py: the products)
    try:
        assert torch.allclose(PackedLinear(bf16, None, kernels)(x),
                              F.linear(x, bf16.float()), atol=1e-5)
    finally:
        kernels.bf16_select(-1)
    for quantize, bits in quant_pack.QUANTIZATIONS.items():
        exact = F.linear(x, torch.from_numpy(quant_pack.quantize(w, bits).dequantized()))
        got = PackedLinear(w, None, kernels, quantize)(x)
        assert (got - exact).abs().max() < (1e-4 if rows <= 2 else 2e-2) * exact.abs().max()
    gate, up = F.linear(x, w[:64]).chunk(2, dim=-1)
    assert torch.allclose(PackedLinear(w[:64], None, kernels, gate_up=True)(x),
                          F.silu(gate) * up, atol=1e-5)


def test_no_rows_is_an_empty_product(kernels: cpu.Kernels) -> None:
    """A prefill chunk whose logits nobody samples sends the head no rows: every weight type
    gives an empty product."""
    w = weights(70, 300)
    layers = [PackedLinear(w, None, kernels), PackedLinear(w.bfloat16(), None, kernels),
              PackedLinear(w[:64], None, kernels, gate_up=True),
              *(PackedLinear(w, None, kernels, q) for q in quant_pack.QUANTIZATIONS)]
    for layer in layers:
        assert layer(torch.empty(0, 300)).shape[0] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_a_prompt_in_two_chunks_gives_the_logits_of_one(kernels: cpu.Kernels, dtype: torch.dtype,
                                                        quantization: str | None) -> None:
    """The first chunk of a chunked prefill asks for no logits (its head gets no rows); the
    second then gives the logits the whole prompt gives in one chunk."""
    config = ModelConfig(vocab_size=64, hidden_size=96, intermediate_size=72, num_layers=2,
                         num_heads=6, num_kv_heads=2, head_dim=32, tie_word_embeddings=True)
    model = DecoderLM(config, torch.device("cpu"), dtype)
    init_random_(model, seed=7)
    cpu_modules.install_(model, kernels, quantization)
    prompt, table = list(range(1, 12)), [0, 1]
    whole = ModelRunner(model, config, num_blocks=4).run([ScheduledChunk(prompt, 0, table, True)])
    runner = ModelRunner(model, config, num_blocks=4)
    assert runner.run([ScheduledChunk(prompt[:5], 0, table, False)]).shape[0] == 0
    last = runner.run([ScheduledChunk(prompt[5:], 5, table, True)])
    assert (last - whole).abs().max() < 1e-3 * whole.abs().max()


@pytest.mark.parametrize("intermediate", [64, 40, 5])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gate_up_writes_act_times_up(kernels: cpu.Kernels, intermediate: int, act: str) -> None:
    w = weights(2 * intermediate, 48)
    x = torch.randn(5, 48) * 4  # large gates: both tails of the activation
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    out = PackedLinear(w, None, kernels, gate_up=True, act=act)(x)
    assert out.shape == (5, intermediate)
    assert torch.allclose(out, ACTIVATIONS[act](gate) * up, atol=1e-5)


def test_an_output_scale_multiplies_weights_and_bias(kernels: cpu.Kernels) -> None:
    w, b, x = weights(40, 64), torch.randn(40), torch.randn(3, 64)
    want = F.linear(x, w, b) * 0.22
    assert torch.allclose(PackedLinear(w, b, kernels, out_scale=0.22)(x), want,
                          atol=1e-5)
    int8 = PackedLinear(w, b, kernels, "int8", out_scale=0.22)(x)
    exact = F.linear(x, torch.from_numpy(quant_pack.quantize(w, 8).dequantized()), b) * 0.22
    assert (int8 - exact).abs().max() < 2e-2 * exact.abs().max()


def test_bfloat16_weights_compute_in_float32(kernels: cpu.Kernels) -> None:
    w = weights(64, 96).bfloat16()
    x = torch.randn(2, 96)
    out = PackedLinear(w, None, kernels)(x)
    assert out.dtype == torch.float32
    assert torch.allclose(out, F.linear(x, w.float()), atol=1e-5)


@pytest.mark.parametrize(("quantize", "levels"), [("int8", 255), ("int4", 16)])
def test_weights_quantize_in_blocks_of_32_inputs(kernels: cpu.Kernels, quantize: str,
                                                 levels: int) -> None:
    w = weights(40, 70)  # 70 inputs: the last block padded
    w[3] *= 100  # a loud row costs the others nothing,
    w[5, :32] *= 100  # nor a loud block the rest of its row
    w[7] = 0  # an all-zero row
    blocks = quant_pack.quantize(w, quant_pack.QUANTIZATIONS[quantize])
    assert blocks.codes.shape == (40, 96) and blocks.inputs == 70
    back = torch.from_numpy(blocks.dequantized())
    step = (w.view(40, -1)[:, :64].reshape(40, 2, 32).abs().amax(-1) * 2 / (levels - 1))
    assert ((back[:, :64] - w[:, :64]).abs().reshape(40, 2, 32) <= step[..., None] * 0.51 + 1e-3).all()
    assert (back[7] == 0).all()
    layer = PackedLinear(w, None, kernels, quantize)
    x = torch.randn(1, 70, generator=torch.Generator().manual_seed(1))
    exact = F.linear(x, back)
    # At one row the activations go in two terms, each within max|x| / 127 / 512 of its
    # value, so each output is within that times its row's sum of |w|. Against the largest
    # output instead, a draw whose loud row cancelled out failed about one run in six.
    bound = F.linear(x.abs().max().expand_as(x), back.abs()) / 127 / 512
    assert ((layer(x) - exact).abs() <= 1.3 * bound + 1e-7).all()
    ids = torch.tensor([0, 3, 39])
    assert torch.allclose(layer.rows(ids), back[ids], atol=1e-6)


def test_rmsnorm_matches_the_torch_module(kernels: cpu.Kernels) -> None:
    norm = RMSNorm(80, 1e-5, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(80))
    x = torch.randn(20, 80)
    assert torch.allclose(KernelRMSNorm(norm, kernels)(x), norm(x), atol=1e-5)


DECODES = [ScheduledChunk([1], 20, [3, 9], True), ScheduledChunk([2], 5, [4], True)]


def both_layers(kernels: cpu.Kernels, model: DecoderLM, decodes_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(CPU layer's output, torch layer's, their caches) for the model's one layer over a
    batch of decodes and prefill chunks (or of decodes only: one kernel call a layer)."""
    runner = ModelRunner(model, model.config, num_blocks=32)
    chunks = DECODES if decodes_only else [
        *DECODES, ScheduledChunk([3, 4, 5], 14, [7, 8], True),
        ScheduledChunk(list(range(6, 15)), 0, [30], True)]
    batch = runner._prepare(chunks)
    torch.manual_seed(0)
    dtype = model.dtype
    x = torch.randn(len(batch.input_ids), model.config.hidden_size).to(dtype)
    angles = batch.positions.float()[:, None, None] * model.inv_freq
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    cache = torch.randn(runner.kv_caches[0].shape).to(dtype)  # context the decodes attend to
    caches = [cache.clone(), cache.clone()]
    with torch.inference_mode():
        want = model.layers[0](x, cos, sin, caches[0], batch.meta)
        layer = CpuDecoderLayer(model.layers[0], model.config, kernels)
        got = layer(x.clone(), cos, sin, caches[1], batch.meta)
    return got, want.float(), caches[1].float(), caches[0].float()


@pytest.mark.parametrize(("dtype", "bias", "head_dim"), [(torch.float32, False, 64),
                                                         (torch.float32, True, 32),
                                                         (torch.bfloat16, False, 64),
                                                         (torch.float32, False, 24)])
@pytest.mark.parametrize("decodes_only", [False, True])
def test_decoder_layer_matches_the_torch_layer(kernels: cpu.Kernels, dtype: torch.dtype,
                                               bias: bool, head_dim: int,
                                               decodes_only: bool) -> None:
    """One layer over a batch of decodes and prefill chunks, or of decodes only (one kernel
    call: tl_layer_decode): same output, same cache."""
    config = ModelConfig(vocab_size=64, hidden_size=96, intermediate_size=72, num_layers=1,
                         num_heads=6, num_kv_heads=2, head_dim=head_dim, qkv_bias=bias)
    model = DecoderLM(config, torch.device("cpu"), dtype)
    init_random_(model, seed=3)
    got, want, cache, cache_want = both_layers(kernels, model, decodes_only)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert (got - want).abs().max() < tol
    assert (cache - cache_want).abs().max() < tol


# Gemma 3 (q/k norms of (1 + w), sandwich norms, GELU-tanh, its own score scale, a sliding
# window), Granite (residual multiplier, attention multiplier, biases), SmolLM3 (no RoPE).
FAMILY_LAYERS = {
    "gemma3": {"qk_norm": True, "norm_unit_offset": True, "sandwich_norms": True,
               "hidden_act": "gelu_pytorch_tanh", "attention_scale": 0.2,
               "layer_types": ["sliding_attention"], "sliding_window": 6},
    "granite": {"residual_multiplier": 0.3, "attention_scale": 0.1, "qkv_bias": True,
                "o_bias": True},
    "smollm3": {"rope_layers": [False], "qk_norm": True},
}


@pytest.mark.parametrize("family", list(FAMILY_LAYERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_family_layer_matches_the_torch_layer(kernels: cpu.Kernels, family: str,
                                              dtype: torch.dtype) -> None:
    config = ModelConfig(vocab_size=64, hidden_size=96, intermediate_size=72, num_layers=1,
                         num_heads=6, num_kv_heads=2, head_dim=32, **FAMILY_LAYERS[family])
    model = DecoderLM(config, torch.device("cpu"), dtype)
    init_random_(model, seed=4)
    with torch.no_grad():  # norms away from 1 (and from 0 for Gemma's 1 + w)
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.normal_(0.3, 0.5)
    got, want, cache, cache_want = both_layers(kernels, model)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert (got - want).abs().max() < tol * want.abs().max().clamp(min=1)
    assert (cache - cache_want).abs().max() < tol


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 64), (9, 3, 64), (8, 8, 32),
                                                             (12, 2, 128), (10, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_reads_the_blocks_in_place(kernels: cpu.Kernels, heads: int,
                                                    kv_heads: int, head_dim: int,
                                                    dtype: torch.dtype) -> None:
    lens = [1, 15, 16, 17, 33, 300]
    cache, tables, lens_t = random_cache(lens, kv_heads, head_dim, dtype=dtype)
    q = torch.randn(len(lens), heads + 2 * kv_heads, head_dim)[:, :heads]  # as the model's view
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), len(lens), tables, lens_t, [])
    want = PagedAttention().decode(q, cache[0].float(), cache[1].float(), meta)
    got = CpuPagedAttention(kernels).decode(q, cache[0], cache[1], meta)
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_reads_only_the_window(kernels: cpu.Kernels, window: int,
                                                dtype: torch.dtype) -> None:
    lens = [1, 15, 16, 17, 33, 300]  # shorter than the window, at it, across blocks
    cache, tables, lens_t = random_cache(lens, 2, 64, dtype=dtype)
    q = torch.randn(len(lens), 6, 64)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), len(lens), tables, lens_t, [])
    want = PagedAttention(0.3, window).decode(q, cache[0].float(), cache[1].float(), meta)
    got = CpuPagedAttention(kernels, 0.3, window).decode(q, cache[0], cache[1], meta)
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize(("lens", "heads", "kv_heads", "block"), [
    ([1000], 9, 3, 16), ([300], 6, 2, 16), ([2049], 4, 4, 16), ([5, 1000], 9, 3, 16),
    ([65, 700, 131], 8, 2, 32), ([1000], 12, 2, 1)])
@pytest.mark.parametrize("window", [None, 40, 500])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_of_few_heads_split_and_merge(kernels: cpu.Kernels, lens: list[int],
                                                    heads: int, kv_heads: int, block: int,
                                                    window: int | None,
                                                    dtype: torch.dtype) -> None:
    """Fewer (sequence, KV head) items than 8 a thread cut each context into parts of whole
    blocks (cpu_attention.c: decode_parts; never on one thread, so 2 here), merged after; a
    short sequence beside a long one has empty parts."""
    cache, tables, lens_t = random_cache(lens, kv_heads, 64, block=block, dtype=dtype)
    q = torch.randn(len(lens), heads, 64)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), len(lens), tables, lens_t, [])
    want = PagedAttention(None, window).decode(q, cache[0].float(), cache[1].float(), meta)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = CpuPagedAttention(kernels, None, window).decode(q, cache[0], cache[1], meta)
    finally:
        torch.set_num_threads(threads)
    assert (got - want).abs().max() < 1e-5


def test_decode_attention_scale_is_one_over_sqrt_head_dim(kernels: cpu.Kernels) -> None:
    # Two keys whose scores differ by exactly sqrt(d) * 1: softmax weights e / (1 + e).
    cache = torch.zeros(2, 1, 1, 16, 64)
    cache[0, 0, 0, 0, 0] = math.sqrt(64)
    cache[1, 0, 0, 0, 0], cache[1, 0, 0, 1, 0] = 1.0, 0.0
    q = torch.zeros(1, 1, 64)
    q[0, 0, 0] = 1.0
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), 1, torch.tensor([[0]]),
                             torch.tensor([2]), [])
    out = CpuPagedAttention(kernels).decode(q, cache[0], cache[1], meta)
    assert math.isclose(float(out[0, 0, 0]), math.e / (1 + math.e), rel_tol=1e-5)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 vector widths")
@pytest.mark.parametrize("arch", ["x86-64-v3", "x86-64"])  # AVX2 (8 lanes), SSE2 (4 lanes)
def test_narrower_vector_builds_compute_the_same(arch: str) -> None:
    """The machine's native build is tested above; these are what AVX2-only or older CPUs
    build, with other tile shapes and an int8 path of their own."""
    lib = cpu.Kernels(cpu._build(arch))
    w, b, x = weights(70, 33), torch.randn(70), torch.randn(5, 33)
    assert torch.allclose(PackedLinear(w, b, lib)(x), F.linear(x, w, b), atol=1e-5)
    for rows in (1, 2, 3, 8, 9, 17, 65):  # every tier of tiles
        many = torch.randn(rows, 300)
        assert torch.allclose(PackedLinear(weights(70, 300), b, lib)(many),
                              F.linear(many, weights(70, 300), b), atol=1e-5)
    exact = F.linear(x, torch.from_numpy(quant_pack.quantize(w, 8).dequantized()))
    assert (PackedLinear(w, None, lib, "int8")(x) - exact).abs().max() < 2e-2 * exact.abs().max()
    gate_up = weights(80, 33)
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    for act, fn in ACTIVATIONS.items():
        assert torch.allclose(PackedLinear(gate_up, None, lib, gate_up=True,
                                           act=act)(x), fn(gate) * up, atol=1e-5)
    lens = [1, 17, 300]
    for dtype in (torch.float32, torch.bfloat16):
        cache, tables, lens_t = random_cache(lens, 2, 64, dtype=dtype)
        q_heads = torch.randn(len(lens), 6, 64)
        meta = AttentionMetadata(torch.empty(0, dtype=torch.long), len(lens), tables, lens_t, [])
        for window in (None, 20):
            want = PagedAttention(None, window).decode(q_heads, cache[0].float(),
                                                       cache[1].float(), meta)
            got = CpuPagedAttention(lib, None, window).decode(q_heads, cache[0], cache[1], meta)
            assert (got - want).abs().max() < 1e-5


def test_build_is_cached_by_source_and_machine(kernels: cpu.Kernels) -> None:
    assert kernels.path.parent == cpu.cache_dir() and kernels.path.is_file()
    assert cpu._build() == kernels.path  # a second start compiles nothing


def test_a_missing_compiler_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CC", "no-such-cc")
    monkeypatch.setenv("TETHER_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"no C compiler.*no-such-cc"):
        cpu._build()


def test_a_failing_compiler_leaves_no_file(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("TETHER_CACHE_DIR", str(tmp_path))
    with pytest.raises((RuntimeError, subprocess.SubprocessError), match="false failed"):
        cpu._build()
    assert list(tmp_path.iterdir()) == []
