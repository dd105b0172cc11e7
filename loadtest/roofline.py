"""The roofline of a decode tick: what one tick must read and compute, against what this
machine can read and compute, plus the host's own cost per tick (issue 24's goal for the
64-stream tick of builtin:tiny: within 2x of max(bytes / bandwidth, FLOPs / peak) + host).

Bandwidth is decode_figures.Bandwidth's `a.sum()`; the fp32 peak a large `torch.mm` at torch's
thread count (the threads the daemon uses); the host cost sim:0's tick (loadtest/host_ticks.py:
the engine around a weightless runner). Imported as a sibling module.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from daemon.model.config import ModelConfig
from loadtest.decode_figures import weight_bytes

PEAK_N = 2048


def peak_flops(rounds: int = 5) -> float:
    """fp32 FLOP/s of a [2048, 2048] @ [2048, 2048] product, best of `rounds`."""
    a, b = torch.randn(PEAK_N, PEAK_N), torch.randn(PEAK_N, PEAK_N)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * PEAK_N**3 / best


def kv_bytes(config: ModelConfig, tokens: int, itemsize: int = 4) -> int:
    """K and V of `tokens` cached tokens, every layer."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * tokens * itemsize


def tick_cost(config: ModelConfig, streams: int, context: int,
              vocab_read: int) -> tuple[int, int]:
    """(bytes read, FLOPs) of one fp32 decode tick of `streams` sequences at `context` tokens:
    every weight once (the head's rows sampled) and each sequence's K/V; the matrix products
    (2 per weight per row) and attention (QK and PV, 2 FLOPs a product each)."""
    nbytes = weight_bytes(config, vocab_read, 4) + streams * kv_bytes(config, context)
    weights = weight_bytes(config, vocab_read, 1)
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * context
    return nbytes, streams * (2 * weights + attention)


def bound(config: ModelConfig, streams: int, context: int, vocab_read: int, bandwidth: float,
          peak: float, host_s: float, tick_s: float) -> dict[str, Any]:
    """The tick's roofline, plus the host cost, against the measured tick."""
    nbytes, flops = tick_cost(config, streams, context, vocab_read)
    roof = max(nbytes / bandwidth, flops / peak)
    return {"streams": streams, "context": context, "bytes": nbytes, "flops": flops,
            "memory_ms": nbytes / bandwidth * 1e3, "compute_ms": flops / peak * 1e3,
            "host_ms": host_s * 1e3, "bound_ms": (roof + host_s) * 1e3,
            "tick_ms": tick_s * 1e3, "ratio": tick_s / (roof + host_s)}
