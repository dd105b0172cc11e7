"""Rotary position embeddings as transformers computes them (its modeling_rope_utils): the
inverse frequencies of each RoPE type, the attention factor YaRN and LongRoPE scale cos and
sin by, and `Rotary`, which turns a batch's positions into the cos/sin tables of a layer.

LongRoPE picks its factors per forward pass in transformers: the long ones when the pass's
last position is past original_max_position_embeddings. A pass there is a sequence's prefill
or one decode step, so here each chunk chooses for its tokens by its own end, which is the
same choice for a prompt prefilled in one chunk and for every decode. (A prompt longer than
that, prefilled in several chunks or recomputed after a preemption, may choose the short
factors for its first chunks where transformers' one pass would choose the long ones.)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from daemon.model.attention import AttentionMetadata


def inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> Tensor:
    """float32 [head_dim / 2]: the frequencies a RoPE type rotates by (LongRoPE: the short
    factors'; freq_factors: llama.cpp's, each frequency divided by its factor). Each formula is
    written as transformers (or llama.cpp) writes it, so the floats agree."""
    powers = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    if scaling is None:
        return 1.0 / powers
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return 1.0 / powers / scaling["factor"]
    if rope_type == "llama3":
        return _llama3(1.0 / powers, scaling)
    if rope_type == "yarn":
        return _yarn(powers, head_dim, theta, scaling)
    factors = scaling["factors" if rope_type == "freq_factors" else "short_factor"]
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * powers)


def long_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> Tensor:
    """LongRoPE's frequencies past original_max_position_embeddings."""
    powers = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * powers)


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by (so attention scores by its square)."""
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    if scaling["rope_type"] == "longrope":
        original = scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _llama3(inv: Tensor, scaling: dict[str, Any]) -> Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
    # in between blends the two so the spectrum stays smooth.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, blended, scaled)


def _yarn(powers: Tensor, head_dim: int, theta: float, scaling: dict[str, Any]) -> Tensor:
    # YaRN: dimensions that turn fewer than beta_slow times over the original context are
    # interpolated by `factor`, those turning more than beta_fast times kept, a ramp between.
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return 1.0 / (factor * powers) * (1 - kept) + 1.0 / powers * kept


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class Rotary(nn.Module):
    """cos/sin [T, 1, head_dim / 2] of one RoPE configuration for a batch's positions."""

    inv_freq: Tensor
    long_inv_freq: Tensor | None

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 device: torch.device) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq(head_dim, theta, scaling).to(device),
                             persistent=False)
        longrope = None if scaling is None or scaling["rope_type"] != "longrope" else scaling
        self.register_buffer("long_inv_freq", None if longrope is None
                             else long_inv_freq(head_dim, theta, longrope).to(device),
                             persistent=False)
        self.threshold = (0 if longrope is None
                          else int(longrope["original_max_position_embeddings"]))
        self.factor = attention_factor(scaling)

    def forward(self, positions: Tensor, meta: AttentionMetadata,
                dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None, None] * self._freqs(positions, meta)
        cos, sin = freqs.cos(), freqs.sin()
        if self.factor != 1.0:
            cos, sin = cos * self.factor, sin * self.factor
        return cos.to(dtype), sin.to(dtype)

    def _freqs(self, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        if self.long_inv_freq is None:
            return self.inv_freq
        # A decode row's chunk ends at the row itself, a prefill chunk at its context length.
        ends = positions + 1
        for span in meta.prefills:
            ends[span.rows] = span.context_len
        long = (ends > self.threshold)[:, None, None]
        return torch.where(long, self.long_inv_freq, self.inv_freq)
