"""A GGUF file's quantized tensors kept quantized on the CPU kernels (--dtype auto), and
dequantized where they cannot be (another dtype, the torch modules)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from daemon.model.kernels import cpu, quant_pack
from daemon.model.kernels.cpu_modules import PackedLinear
from daemon.model.loader import load_model
from tests.daemon.model.test_gguf import PROMPT, logits, mixed, wide_llama
from tests.support.gguf_files import Q, write_gguf

__all__ = ["mixed"]  # the fixture: a tiny Llama holding Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1
LONG_PROMPT = [(7 * i + 3) % 300 for i in range(30)]  # 30 rows: past the one-row kernels


def test_quantized_tensors_are_computed_on_as_they_are(mixed: Path) -> None:
    kept = load_model(str(mixed), "cpu", "auto")
    assert kept.kernels == "cpu" and not kept.model.quantized
    layer = kept.model.layers[0]
    types = {name: getattr(layer, name).desc.type for name in ("qkv", "o", "gate_up", "down")}
    # q, k, v of Q4_K, Q5_K, Q6_K as one weight: 16-input blocks of byte codes; gate and up
    # (Q4_0, Q4_1) in nibbles; the BF16 down projection is a float weight, in float32.
    assert types == {"qkv": quant_pack.TL_Q8_16, "o": quant_pack.TL_Q8,
                     "gate_up": quant_pack.TL_Q4, "down": 0}
    reference = load_model(str(mixed), "cpu", "float32")
    assert isinstance(reference.model.layers[0].qkv, PackedLinear)
    assert reference.model.layers[0].qkv.desc.type == 0  # dequantized to float32
    # int8 activations (and the K-quants' scales as float16): close, not equal
    ours, want = logits(kept, PROMPT), logits(reference, PROMPT)
    assert (ours - want).abs().mean() < 0.02 * want.abs().mean()
    assert (ours.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_the_torch_modules_get_the_file_dequantized(mixed: Path) -> None:
    torch_path = load_model(str(mixed), "cpu", "auto", kernels="torch")
    assert torch_path.kernels == "torch" and not torch_path.model.quantized
    reference = load_model(str(mixed), "cpu", "float32", kernels="torch")
    torch.testing.assert_close(logits(torch_path, PROMPT), logits(reference, PROMPT),
                               rtol=1e-3, atol=1e-3)


QUANT_TIERS = ["generic", "avx2", "avx-vnni", "avx512-vnni"]  # quant.c's order
BF16_TIERS = ["none", "avx512-bf16", "amx-bf16"]  # bf16.c's order


def _forced(select: Callable[[int], int], names: list[str]) -> Iterator[str]:
    """Each tier this CPU has, forced in turn (the lower ones too); the best one afterwards."""
    try:
        for t, name in enumerate(names):
            if select(t) == t:
                yield name
    finally:
        select(-1)


def test_every_kernel_tier_gives_the_same_tokens(mixed: Path) -> None:
    """A whole model on each quantized tier (the file's blocks) and each bf16 tier
    (--dtype bfloat16) this CPU has, forced: within the tolerance above of float32, the same
    greedy tokens as the best tier at >= 90% of positions (int8 or bf16 rounding moves
    near-ties only)."""
    from daemon.model.kernels import cpu

    lib = cpu.load()
    assert lib is not None
    want = logits(load_model(str(mixed), "cpu", "float32"), PROMPT)
    for dtype, select, names in (("auto", lib.quant_select, QUANT_TIERS),
                                 ("bfloat16", lib.bf16_select, BF16_TIERS)):
        model = load_model(str(mixed), "cpu", dtype)
        best = logits(model, PROMPT).argmax(-1)
        ran = []
        for name in _forced(select, names):
            ours = logits(model, PROMPT)
            assert (ours - want).abs().mean() < 0.02 * want.abs().mean(), (dtype, name)
            assert (ours.argmax(-1) == best).float().mean() >= 0.9, (dtype, name)
            ran.append(name)
        assert ran and ran[0] == names[0], ran  # the lowest tier forced too


@pytest.fixture(scope="module")
def eight_bit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The mixed file's model with every matrix in Q8_0."""
    path = tmp_path_factory.mktemp("gguf-q8") / "tiny-llama.Q8_0.gguf"
    return write_gguf(path, wide_llama(), lambda _: Q.Q8_0)


def test_eight_bit_layers_take_two_term_activations_at_every_row_count(
        eight_bit: Path, mixed: Path) -> None:
    """A Q8_0 file's weights, head included, take their activations in two terms at prefill's
    row counts too (cpu_modules.py: two_term_rows): its logits over a prompt stay as close to
    float32 on the same weights as one row's do. A file with 4-bit layers keeps one term past
    two rows, its 8-bit head too."""
    kept = load_model(str(eight_bit), "cpu", "auto")
    packed = [m for m in kept.model.modules() if isinstance(m, PackedLinear)]
    assert {m.desc.type for m in packed} == {quant_pack.TL_Q8}
    assert {m.desc.two_term_rows for m in packed} == {cpu.ALL_ROWS}
    reference = load_model(str(eight_bit), "cpu", "float32")
    ours, want = logits(kept, LONG_PROMPT), logits(reference, LONG_PROMPT)
    assert (ours - want).abs().max() < 1e-3 * want.abs().max()
    four = load_model(str(mixed), "cpu", "auto")
    assert {m.desc.two_term_rows for m in four.model.modules()
            if isinstance(m, PackedLinear)} == {cpu.TWO_TERM_ROWS}
