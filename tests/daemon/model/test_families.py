"""The families beside Llama against transformers (fp32), on the CPU kernels and on the torch
modules: Qwen3, Gemma 3, Phi-3 (fused checkpoint, LongRoPE), SmolLM3, Granite, and Mistral's
and Qwen2's with a sliding window / YaRN. Each tiny random checkpoint turns on every way its
family differs from Llama (tests/support/checkpoints.py), sliding windows of 16 tokens with
prompts and generations running past them."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from daemon.model.loader import load_model
from daemon.model.runner import ModelRunner, ScheduledChunk
from tests.support.checkpoints import FAMILIES, LONGROPE_AFTER, WINDOW
from tests.support.greedy import PROMPTS, greedy, transformers_greedy

pytestmark = pytest.mark.timeout(300)

Family = Callable[[str], tuple[Path, Any]]  # name -> (directory, transformers model)
KERNELS = pytest.mark.parametrize("kernels", ["auto", "torch"])
FAMILY = pytest.mark.parametrize("name", list(FAMILIES))
NUM_BLOCKS = 12  # few enough that four prompts of 32 new tokens each preempt
BUDGET = 24  # tokens a tick: the prompts are prefilled in chunks
NEW_TOKENS = 32


def load(path: Path, kernels: str = "auto", dtype: torch.dtype = torch.float32,
         num_blocks: int = NUM_BLOCKS, quantization: str | None = None) -> ModelRunner:
    loaded = load_model(str(path), "cpu", dtype, kernels=kernels, quantization=quantization)
    assert loaded.kernels == ("cpu" if kernels == "auto" else "torch")
    return ModelRunner(loaded.model, loaded.config, num_blocks=num_blocks)


@FAMILY
@KERNELS
def test_greedy_tokens_through_the_engine_match_transformers(family: Family, name: str,
                                                             kernels: str) -> None:
    path, hf = family(name)
    loaded = load_model(str(path), "cpu", torch.float32, kernels=kernels)
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=NUM_BLOCKS)
    got, engine = greedy(runner, loaded, PROMPTS, NEW_TOKENS, BUDGET)
    assert engine.scheduler.num_preemptions > 0  # the scenario does preempt
    assert len(got) == 5 and all(len(t) == NEW_TOKENS for t in got.values())
    assert all(len(loaded.tokenizer.encode(p)) > BUDGET for p in PROMPTS[:2])  # chunked
    assert got == transformers_greedy(hf, loaded, PROMPTS, NEW_TOKENS)


def reference_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


@FAMILY
@KERNELS
def test_chunks_past_the_window_and_decodes_match_transformers(family: Family, name: str,
                                                               kernels: str) -> None:
    """Prefill chunks that start inside the window, past it and past whole blocks of it, each
    chunk's last logits against transformers' over the whole prefix."""
    path, hf = family(name)
    runner = load(path, kernels, num_blocks=8)
    ids = [(7 * i + 3) % 290 + 2 for i in range(45)]
    blocks, at = [5, 0, 7, 2], 0
    for size in (7, 20, 13, 5):
        logits = runner.run([ScheduledChunk(ids[at : at + size], at, blocks, True)])
        at += size
        assert (logits[0] - reference_logits(hf, ids[:at])).abs().max() <= 1e-4, at
    assert at > 2 * WINDOW


@pytest.mark.parametrize("name", ["gemma3", "phi3", "granite"])
@KERNELS
def test_bfloat16_is_as_close_to_float32_as_transformers_in_bfloat16(
        family: Family, name: str, kernels: str) -> None:
    path, hf = family(name)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    runner = load(path, kernels, torch.bfloat16, num_blocks=8)
    ids = [(5 * i + 1) % 290 + 2 for i in range(30)]
    ours = runner.run([ScheduledChunk(ids, 0, [1, 2], True)])[0]
    exact, theirs = reference_logits(hf, ids), reference_logits(hf16, ids)
    assert (ours - theirs).abs().max() <= 2 * (theirs - exact).abs().max() + 1e-3


@pytest.mark.parametrize("name", ["gemma3", "granite", "qwen3"])
def test_int8_weights_stay_close_to_float32(family: Family, name: str) -> None:
    path, hf = family(name)
    runner = load(path, num_blocks=8, quantization="int8")
    ids = [(5 * i + 1) % 290 + 2 for i in range(30)]
    logits = runner.run([ScheduledChunk(ids, 0, [1, 2], True)])[0]
    exact = reference_logits(hf, ids).log_softmax(-1)
    kl = (exact.exp() * (exact - logits.log_softmax(-1))).sum()
    assert 0 < kl < 2e-2


@KERNELS
def test_longrope_takes_the_long_factors_for_a_pass_ending_past_the_original_context(
        family: Family, kernels: str) -> None:
    """As transformers' forward over the same cache: a prompt longer than
    original_max_position_embeddings prefilled in one pass, decodes past it."""
    path, hf = family("phi3")
    runner = load(path, kernels, num_blocks=16)
    ids = [(3 * i + 1) % 290 + 2 for i in range(LONGROPE_AFTER + 10)]
    blocks = list(range(16))
    logits = runner.run([ScheduledChunk(ids[:-4], 0, blocks, True)])
    assert (logits[0] - reference_logits(hf, ids[:-4])).abs().max() <= 1e-4
    with torch.no_grad():
        cache = hf(torch.tensor([ids[:-4]]), use_cache=True).past_key_values
        for at in range(len(ids) - 4, len(ids)):
            logits = runner.run([ScheduledChunk([ids[at]], at, blocks, True)])
            theirs = hf(torch.tensor([[ids[at]]]), cache=cache, use_cache=True)
            cache = theirs.past_key_values
            assert (logits[0] - theirs.logits[0, -1]).abs().max() <= 1e-4
