"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) over a flattened batch of tokens, with
the variants of the families config.py reads: per-head q/k norms (Qwen3, Gemma 3), Gemma's
(1 + w) and sandwich norms, GELU-tanh and scaled embeddings, sliding-window layers with their
own RoPE, layers without RoPE (SmolLM3), Granite's multipliers. Each is off for Llama.

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

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

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
from daemon.model.rope import Rotary

if TYPE_CHECKING:
    from daemon.model.kernels.quant_pack import Blocks


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, head_dim]; cos/sin [T, 1, head_dim / 2] (rotate-half layout, as HF)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


class RMSNorm(nn.Module):
    """unit_offset: Gemma's norm, which scales by (1 + weight) in float32 before the cast back
    (Llama's casts first, then scales by the weight)."""

    def __init__(self, dim: int, eps: float, device: torch.device, dtype: torch.dtype,
                 unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        self.eps, self.unit_offset = eps, unit_offset

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 whatever the weight dtype, like the reference implementation.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)

    def scale(self) -> Tensor:
        """What the normalised values are multiplied by, float32 (for the kernels)."""
        weight = self.weight.detach().float()
        return (1.0 + weight if self.unit_offset else weight).contiguous()


class Attention(nn.Module):
    """This rank's query heads and the KV heads they read (all of them with one rank) in
    layer `layer`: its window, whether it applies RoPE, and Qwen3's and Gemma 3's per-head
    query and key norms (whole on every rank)."""

    def __init__(self, cfg: ModelConfig, layer: int, device: torch.device, dtype: torch.dtype,
                 group: TPGroup) -> None:
        super().__init__()
        q, kv = head_parts(cfg, group)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            q.stop - q.start, kv.stop - kv.start, cfg.head_dim)
        q, kv = q.scaled(cfg.head_dim), kv.scaled(cfg.head_dim)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, (q, kv, kv), cfg.qkv_bias,
                                             device, dtype)
        self.o_proj = RowParallelLinear(q, cfg.hidden_size, cfg.o_bias, device, dtype, group)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device, dtype,
                                  cfg.norm_unit_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device, dtype,
                                  cfg.norm_unit_offset)
        self.rope = cfg.rope_layers[layer]
        self.paged = PagedAttention(cfg.attention_scale, cfg.window(layer))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata) -> Tensor:
        qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x).view(x.shape[0], qk_heads + self.num_kv_heads, self.head_dim)
        qk = qkv[:, :qk_heads]
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]),
                            self.k_norm(qk[:, self.num_heads :])), dim=1)
        if self.rope:
            qk = apply_rope(qk, cos, sin)
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
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """post_attention_norm is the norm before the MLP. With sandwich norms (Gemma 3) the
    attention and MLP outputs are normed too before they join the residual stream; Granite
    scales them by residual_multiplier."""

    def __init__(self, cfg: ModelConfig, layer: int, device: torch.device, dtype: torch.dtype,
                 group: TPGroup) -> None:
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype, cfg.norm_unit_offset)

        self.input_norm = norm()
        self.attn = Attention(cfg, layer, device, dtype, group)
        self.post_attention_norm = norm()
        self.mlp = MLP(cfg, device, dtype, group)
        self.attn_out_norm = norm() if cfg.sandwich_norms else None
        self.mlp_out_norm = norm() if cfg.sandwich_norms else None
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata) -> Tensor:
        x = x + self._branch(self.attn(self.input_norm(x), cos, sin, kv_cache, meta),
                             self.attn_out_norm)
        return x + self._branch(self.mlp(self.post_attention_norm(x)), self.mlp_out_norm)

    def _branch(self, out: Tensor, norm: RMSNorm | None) -> Tensor:
        """What a branch adds to the residual stream."""
        if norm is not None:
            out = norm(out)
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier


DecodeStack = Callable[[Tensor, list[tuple[Tensor, Tensor]], list[Tensor], AttentionMetadata],
                      Tensor]


class DecoderLM(nn.Module):
    """Parameters are allocated uninitialised; the loader fills them (checkpoint or seed).

    vocab_limit: ids >= this get -inf logits (a padded vocabulary the tokenizer cannot
    decode, as in builtin:small); None = every id may be sampled.
    group: the tensor-parallel ranks; this one holds its shard of every layer
    (daemon/model/parallel/layers.py) and the KV heads its query heads read (`num_kv_heads`).
    """

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 vocab_limit: int | None = None, group: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype  # the weights' and the KV cache's
        self.vocab_limit = vocab_limit
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, device,
                                                   dtype, group)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, device, dtype, group)
                                    for i in range(cfg.num_layers))
        self.num_kv_heads = local_kv_heads(cfg, group)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype,
                            cfg.norm_unit_offset)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, device, dtype,
                                            group))
        # One table per distinct RoPE (Gemma 3: its global and its sliding layers').
        ropes = [cfg.rope_of(i) for i in range(cfg.num_layers)]
        distinct = [r for i, r in enumerate(ropes) if r not in ropes[:i]]
        self.rotaries = nn.ModuleList(Rotary(cfg.head_dim, theta, scaling, device)
                                      for theta, scaling in distinct)
        self.rotary_of = [distinct.index(r) for r in ropes]
        self.embed_scale = cfg.embedding_multiplier
        # Parameters a GGUF file holds quantized, kept so for the CPU kernels (which pack them
        # at install); their tensors here are left unfilled.
        self.quantized: dict[str, Blocks] = {}
        # A backend's whole layer stack for batches of decodes only (the CPU kernels': every
        # layer in one call); it takes the embedded rows, the RoPE tables and the caches.
        self.decode_stack: DecodeStack | None = None
        # A backend whose precision depends on a call's row count (the CPU kernels' quantized
        # activations) counts a step's rows as this many while set (None: as they are).
        self.count_rows_as: Callable[[int | None], None] | None = None
        if cfg.scale_embeddings:  # rounded to the weights' dtype, as transformers does
            self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5).to(dtype).item()

    @property
    def inv_freq(self) -> Tensor:
        """The first layer's RoPE frequencies (their device is the model's)."""
        return cast(Rotary, self.rotaries[0]).inv_freq

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata,
                kv_caches: list[Tensor]) -> Tensor:
        """Hidden states [T, hidden] before the final norm; see `compute_logits`."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        tables = [rotary(positions, meta, x.dtype) for rotary in self.rotaries]
        if self.decode_stack is not None and not meta.prefills:
            return self.decode_stack(x, tables, kv_caches, meta)
        for layer, kv_cache, i in zip(self.layers, kv_caches, self.rotary_of, strict=True):
            x = layer(x, *tables[i], kv_cache, meta)
        return x

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """float32 logits for the rows given (only the rows that are sampled), gathered on
        rank 0."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = head.logits(self.norm(hidden), self.vocab_limit)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap is not None:  # ids masked to -inf stay there
            logits = torch.where(logits.isneginf(), logits, torch.tanh(logits / cap) * cap)
        return logits
