"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) over a flattened batch of tokens.

The model knows nothing about sequences. It sees tokens [T], their positions [T] and an
`AttentionMetadata` saying where each token's K/V goes in the paged cache and which cached
keys each query may read (daemon/model/attention.py). Rows of the batch are ordered decode tokens
first (one per sequence), then prefill chunks.

The modules here are the torch reference. On CUDA the loader swaps in a Triton decode
attention (`Attention.paged`); on CPU, with one rank, it swaps each whole `DecoderLayer`, the
final norm, the embedding and the head for compiled kernels over packed weights, keeping the
forward signatures (daemon/model/kernels/).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from daemon.model.attention import AttentionMetadata, PagedAttention
from daemon.model.config import ModelConfig
from daemon.model.parallel.group import SINGLE, TPGroup
from daemon.model.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    Part,
    RowParallelLinear,
    VocabParallelEmbedding,
    head_parts,
    local_kv_heads,
)


def rope_inv_freq(config: ModelConfig) -> Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict[str, float]) -> Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
    # in between blends the two so the spectrum stays smooth.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, blended, scaled)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, head_dim]; cos/sin [T, 1, head_dim / 2] (rotate-half layout, as HF)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 whatever the weight dtype, like the reference implementation.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    """This rank's query heads and the KV heads they read (all of them with one rank)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 group: TPGroup) -> None:
        super().__init__()
        q, kv = head_parts(cfg, group)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            q.stop - q.start, kv.stop - kv.start, cfg.head_dim)
        q, kv = q.scaled(cfg.head_dim), kv.scaled(cfg.head_dim)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, (q, kv, kv), cfg.qkv_bias,
                                             device, dtype)
        self.o_proj = RowParallelLinear(q, cfg.hidden_size, cfg.o_bias, device, dtype, group)
        self.paged = PagedAttention()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata) -> Tensor:
        qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x).view(x.shape[0], qk_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rope(qkv[:, :qk_heads], cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = self.paged(q, k, qkv[:, qk_heads:], kv_cache, meta)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 group: TPGroup) -> None:
        super().__init__()
        part = Part.split(cfg.intermediate_size, group.rank, group.size)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, (part, part), False,
                                                 device, dtype)
        self.down_proj = RowParallelLinear(part, cfg.hidden_size, False, device, dtype, group)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 group: TPGroup) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.attn = Attention(cfg, device, dtype, group)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.mlp = MLP(cfg, device, dtype, group)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata) -> Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_norm(x))


class DecoderLM(nn.Module):
    """Parameters are allocated uninitialised; the loader fills them (checkpoint or seed).

    vocab_limit: ids >= this get -inf logits (a padded vocabulary the tokenizer cannot
    decode, as in builtin:small); None = every id may be sampled.
    group: the tensor-parallel ranks; this one holds its shard of every layer
    (daemon/model/parallel/layers.py) and the KV heads its query heads read (`num_kv_heads`).
    """

    inv_freq: Tensor

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 vocab_limit: int | None = None, group: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype  # the weights' and the KV cache's
        self.vocab_limit = vocab_limit
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, device,
                                                   dtype, group)
        self.layers = nn.ModuleList(DecoderLayer(cfg, device, dtype, group)
                                    for _ in range(cfg.num_layers))
        self.num_kv_heads = local_kv_heads(cfg, group)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, device, dtype,
                                            group))
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata,
                kv_caches: list[Tensor]) -> Tensor:
        """Hidden states [T, hidden] before the final norm; see `compute_logits`."""
        x = self.embed_tokens(input_ids)
        freqs = positions.float()[:, None, None] * self.inv_freq
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return x

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """float32 logits for the rows given (only the rows that are sampled), gathered on
        rank 0."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return head.logits(self.norm(hidden), self.vocab_limit)
