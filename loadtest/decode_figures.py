"""In-process decode figures for bench_engine.py: read bandwidth, weight bytes per token, forward
ticks, tick scaling with streams and context, and the logit KL of a weight format.

Every figure is measured in the calling process, A/B interleaved round by round (each variant
sees the same background load), best of the rounds. Imported as a sibling module.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from daemon.model.batch import ScheduledChunk
from daemon.model.config import ModelConfig
from daemon.model.loader import LoadedModel, load_model
from daemon.model.runner import ModelRunner

BLOCK = 16


class Bandwidth:
    """Read bandwidth as `a.sum()` over a float32 tensor of `gib` GiB, at torch's thread count."""

    def __init__(self, gib: float = 1.0) -> None:
        self.a = torch.ones(int(gib * (1 << 30)) // 4)
        self.nbytes = self.a.numel() * 4

    def seconds(self) -> float:
        return _timed(self.a.sum)


def weight_bytes(config: ModelConfig, vocab_read: int, bytes_per_weight: float) -> int:
    """What one decode token reads: every linear of every layer and the head rows sampled."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    qkv = (config.num_heads + 2 * config.num_kv_heads) * d * h
    per_layer = qkv + config.num_heads * d * h + 2 * i * h + i * h
    return int((per_layer * config.num_layers + vocab_read * h) * bytes_per_weight)


def model_weight_bytes(loaded: LoadedModel, quantization: str | None) -> int:
    # Blocks of 32 codes with a float16 scale and offset (daemon/model/kernels/quant.h).
    itemsize = {"int8": 36 / 32, "int4": 20 / 32}.get(quantization or "", loaded.model.dtype.itemsize)
    # Head rows past the tokenizer's vocabulary are never read: a token needs no logit there.
    limit = loaded.model.vocab_limit
    return weight_bytes(loaded.config, limit or loaded.config.vocab_size, itemsize)


class Ticker:
    """One model and cache; `tick(streams, context)` times one decode forward of that batch."""

    def __init__(self, spec: str, kernels: str, dtype: str = "float32",
                 quantization: str | None = None, max_tokens: int = 64 * 2100) -> None:
        self.loaded = load_model(spec, "cpu", dtype, kernels=kernels, quantization=quantization)
        self.kernels, self.quantization = self.loaded.kernels, quantization
        self.runner = ModelRunner(self.loaded.model, self.loaded.config,
                                  num_blocks=max_tokens // BLOCK + 1)

    def chunks(self, streams: int, context: int) -> list[ScheduledChunk]:
        per_seq = context // BLOCK + 1
        if streams * per_seq > self.runner.num_blocks:
            raise ValueError(f"{streams} x {context} tokens exceed the bench's cache")
        return [ScheduledChunk([5], context, list(range(s * per_seq, (s + 1) * per_seq)), True)
                for s in range(streams)]

    def tick(self, chunks: list[ScheduledChunk]) -> float:
        return _timed(lambda: self.runner.run(chunks))


def interleaved(calls: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Best of `rounds` for each call, the calls taking turns within each round."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for key, call in calls.items():
            best[key] = min(best[key], call())
    return best


def tick_scaling(tickers: dict[str, Ticker], streams: Sequence[int], contexts: Sequence[int],
                 rounds: int) -> list[dict[str, Any]]:
    """ms per decode tick for each (streams, context), one column per ticker."""
    rows = []
    for n in streams:
        for context in contexts:
            batches = {name: t.chunks(n, context) for name, t in tickers.items()}
            for name, t in tickers.items():
                t.tick(batches[name])  # warm
            best = interleaved({name: functools.partial(t.tick, batches[name])
                                for name, t in tickers.items()}, rounds)
            rows.append({"streams": n, "context": context,
                         **{name: ms * 1e3 for name, ms in best.items()}})
    return rows


@torch.inference_mode()
def logit_kl(reference: Ticker, variants: dict[str, Ticker], prompts: Sequence[list[int]],
             steps: int) -> dict[str, dict[str, float]]:
    """KL(reference || variant) of the next-token distribution, teacher-forced along the
    reference's greedy continuation of each prompt: mean and max over positions, and how
    often the two argmaxes agree."""
    kls: dict[str, list[float]] = {name: [] for name in variants}
    agree: dict[str, int] = dict.fromkeys(variants, 0)
    total = 0
    for prompt in prompts:
        ids = list(prompt)
        tickers = {"ref": reference, **variants}
        blocks = list(range((len(prompt) + steps) // BLOCK + 1))
        logits = {k: t.runner.run([ScheduledChunk(ids, 0, blocks, True)])[0]
                  for k, t in tickers.items()}
        for step in range(steps):
            ref_logp = torch.log_softmax(logits["ref"], -1)
            for name in variants:
                logp = torch.log_softmax(logits[name], -1)
                finite = torch.isfinite(ref_logp)
                kl = (ref_logp.exp() * (ref_logp - logp))[finite].sum()
                kls[name].append(float(kl))
                agree[name] += int(logits[name].argmax() == logits["ref"].argmax())
            total += 1
            if step == steps - 1:
                break
            ids.append(int(logits["ref"].argmax()))
            chunk = ScheduledChunk(ids[-1:], len(ids) - 1, blocks, True)
            logits = {k: t.runner.run([chunk])[0] for k, t in tickers.items()}
    return {name: {"kl_mean": sum(v) / len(v), "kl_max": max(v), "top1_agree": agree[name] / total}
            for name, v in kls.items()}


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
