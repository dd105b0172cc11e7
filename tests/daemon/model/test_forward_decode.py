"""The CPU kernels' layer stack of a decode-only batch in one call (cpu_forward.c,
cpu_modules.KernelDecodeStack) against the same layers called one by one."""

from __future__ import annotations

import pytest
import torch

from daemon.model.config import ModelConfig
from daemon.model.decoder import DecoderLM
from daemon.model.kernels import cpu, cpu_modules
from daemon.model.loader import init_random_
from daemon.model.runner import ModelRunner, ScheduledChunk

# Layers that differ in what a step holds: two RoPE tables (Gemma 3's sliding layers have their
# own theta), a window on the sliding layers only, one layer without RoPE.
CONFIG = {"qk_norm": True, "norm_unit_offset": True, "sandwich_norms": True,
          "hidden_act": "gelu_pytorch_tanh", "attention_scale": 0.2,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                          "full_attention"],
          "sliding_window": 6, "rope_theta": 1e6, "sliding_rope_theta": 1e4,
          "rope_layers": [True, True, True, False]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_the_stack_gives_what_the_layers_give(dtype: torch.dtype, quantization: str | None
                                              ) -> None:
    """Two sequences decoded 12 ticks past a block boundary, through the stack and through the
    layers one call each: the same logits, bit for bit, and the same caches."""
    lib = cpu.load()
    assert lib is not None, cpu.failure()
    config = ModelConfig(vocab_size=64, hidden_size=96, intermediate_size=72, num_layers=4,
                         num_heads=6, num_kv_heads=2, head_dim=32, **CONFIG)
    model = DecoderLM(config, torch.device("cpu"), dtype)
    init_random_(model, seed=5)
    cpu_modules.install_(model, lib, quantization)
    stack = model.decode_stack
    assert isinstance(stack, cpu_modules.KernelDecodeStack)
    runners = {on: ModelRunner(model, config, num_blocks=8) for on in (True, False)}
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    tables = [[0, 1, 2], [3, 4]]
    first = [ScheduledChunk(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)]
    logits = {on: r.run(first) for on, r in runners.items()}
    tokens = logits[True].argmax(-1).tolist()
    for step in range(12):
        chunks = [ScheduledChunk([tok], len(p) + step, t, True)
                  for tok, p, t in zip(tokens, prompts, tables, strict=True)]
        for on, runner in runners.items():
            model.decode_stack = stack if on else None
            logits[on] = runner.run(chunks).clone()
        assert torch.equal(logits[True], logits[False]), step
        tokens = logits[True].argmax(-1).tolist()
    assert stack.calls == 12
    for got, want in zip(runners[True].kv_caches, runners[False].kv_caches, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_a_drafted_chunk_through_the_stack_gives_the_logits_of_one_at_a_time(
        quantization: str | None) -> None:
    """A speculative verify ([last token] + drafts, a row each) runs through the one-call stack
    as decodes at consecutive positions, and gives the logits of decoding the tokens one pass at
    a time: each layer writes every row's K and V before any row attends (past the sliding
    window of 6, so the window's edge moves within the chunk)."""
    lib = cpu.load()
    assert lib is not None, cpu.failure()
    config = ModelConfig(vocab_size=64, hidden_size=96, intermediate_size=72, num_layers=4,
                         num_heads=6, num_kv_heads=2, head_dim=32, **CONFIG)
    model = DecoderLM(config, torch.device("cpu"), torch.float32)
    init_random_(model, seed=7)
    cpu_modules.install_(model, lib, quantization)
    stack = model.decode_stack
    assert isinstance(stack, cpu_modules.KernelDecodeStack)
    one, drafted = (ModelRunner(model, config, num_blocks=4) for _ in range(2))
    prompt, table, tokens = list(range(1, 12)), [0, 1], [5, 9, 9, 2, 7]
    for runner in (one, drafted):
        runner.run([ScheduledChunk(prompt, 0, table, True)])
    want = torch.cat([one.run([ScheduledChunk([t], len(prompt) + j, table, True)]).clone()
                      for j, t in enumerate(tokens)])
    calls = stack.calls
    got = drafted.run([ScheduledChunk(tokens, len(prompt), table, True, all_logits=True,
                                      drafted=True)])
    assert stack.calls == calls + 1
    assert (got - want).abs().max() < 1e-4, float((got - want).abs().max())
    for a, b in zip(one.kv_caches, drafted.kv_caches, strict=True):
        assert torch.equal(a, b)
