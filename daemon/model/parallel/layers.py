"""Megatron-style sharded layers: each knows which slice of the full weight its rank holds.

Column-parallel linears (fused qkv, gate_up) split their output features and need no
communication; row-parallel ones (o_proj, down_proj) split their input features and sum the
partial products with one all-reduce. The embedding and the LM head split the vocabulary:
lookups are masked to the rank's rows and all-reduced, logits are gathered on rank 0.

A parameter carries a `ShardSpec` saying how it is cut from the full tensor, so the loader
reads only its slice of a checkpoint (or cuts it from a seeded full tensor), whatever the
layer. With one rank every spec is the whole tensor and the layers compute exactly what
daemon/model/decoder.py's plain ones do.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from daemon.model.config import ConfigError, ModelConfig
from daemon.model.parallel.group import SINGLE, TPGroup

_SHARD_ATTR = "tp_shard"


@dataclasses.dataclass(frozen=True, slots=True)
class Part:
    """One part of a full tensor along the split dim (q, k or v of a fused qkv) and the slice
    [start, stop) of it this rank holds."""

    size: int
    start: int
    stop: int

    @classmethod
    def split(cls, size: int, rank: int, num: int) -> Part:
        each = size // num
        return cls(size, rank * each, (rank + 1) * each)

    def scaled(self, k: int) -> Part:
        return Part(self.size * k, self.start * k, self.stop * k)


@dataclasses.dataclass(frozen=True, slots=True)
class ShardSpec:
    """Along `dim` the parameter is this rank's slice of each part, concatenated, then `pad`
    zero rows (a vocabulary that does not divide by the number of ranks)."""

    dim: int
    parts: tuple[Part, ...]
    pad: int = 0

    def full_shape(self, shape: torch.Size) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] = sum(p.size for p in self.parts)
        return tuple(out)

    def take(self, full: Tensor) -> Tensor:
        """This rank's parameter cut from the full tensor."""
        pieces = full.split([p.size for p in self.parts], dim=self.dim)
        return self.assemble([piece.narrow(self.dim, p.start, p.stop - p.start)
                              for piece, p in zip(pieces, self.parts, strict=True)])

    def assemble(self, slices: Sequence[Tensor]) -> Tensor:
        out = torch.cat(list(slices), dim=self.dim) if len(slices) > 1 else slices[0]
        if not self.pad:
            return out
        shape = list(out.shape)
        shape[self.dim] = self.pad
        return torch.cat([out, out.new_zeros(shape)], dim=self.dim)


def shard_of(param: Tensor) -> ShardSpec | None:
    """How `param` is cut from the full tensor; None: it is the whole tensor on every rank."""
    return getattr(param, _SHARD_ATTR, None)


def _mark(param: nn.Parameter | None, spec: ShardSpec) -> None:
    if param is not None:
        setattr(param, _SHARD_ATTR, spec)


# --- heads ------------------------------------------------------------------------------------


def check_shardable(cfg: ModelConfig, num_ranks: int) -> None:
    """Raises ConfigError naming the field that does not divide by the number of ranks."""
    if num_ranks == 1:
        return
    flag = f"--tensor-parallel-size {num_ranks}"
    for field, value in (("num_attention_heads", cfg.num_heads),
                         ("intermediate_size", cfg.intermediate_size)):
        if value % num_ranks:
            raise ConfigError(f"{field} ({value}) is not divisible by {flag}")
    kv = cfg.num_kv_heads
    if kv % num_ranks and num_ranks % kv:
        raise ConfigError(f"num_key_value_heads ({kv}) and {flag}: one must divide the other "
                          "(KV heads are split, or replicated when there are fewer than ranks)")


def head_parts(cfg: ModelConfig, group: TPGroup) -> tuple[Part, Part]:
    """(query heads, KV heads) this rank holds. With fewer KV heads than ranks each KV head is
    replicated on the ranks whose query heads read it, as vLLM does."""
    rank, num = group.rank, group.size
    q = Part.split(cfg.num_heads, rank, num)
    if cfg.num_kv_heads % num == 0:
        return q, Part.split(cfg.num_kv_heads, rank, num)
    kv = rank // (num // cfg.num_kv_heads)
    return q, Part(cfg.num_kv_heads, kv, kv + 1)


def local_kv_heads(cfg: ModelConfig, group: TPGroup = SINGLE) -> int:
    _, kv = head_parts(cfg, group)
    return kv.stop - kv.start


# --- layers -----------------------------------------------------------------------------------


class Linear(nn.Module):
    """nn.Linear without its init: weights always come from a checkpoint or a seeded fill."""

    def __init__(self, n_in: int, n_out: int, bias: bool, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(n_out, device=device, dtype=dtype)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim, device=device, dtype=dtype))

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight)


class ColumnParallelLinear(Linear):
    """Output features split: of each fused part (q, k, v; gate, up) this rank holds a slice."""

    def __init__(self, n_in: int, parts: Sequence[Part], bias: bool, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__(n_in, sum(p.stop - p.start for p in parts), bias, device, dtype)
        spec = ShardSpec(0, tuple(parts))
        _mark(self.weight, spec)
        _mark(self.bias, spec)


class RowParallelLinear(Linear):
    """Input features split; the partial products are summed across ranks (one all-reduce).
    The bias is whole on every rank and added once, after the sum."""

    def __init__(self, part: Part, n_out: int, bias: bool, device: torch.device,
                 dtype: torch.dtype, group: TPGroup) -> None:
        super().__init__(part.stop - part.start, n_out, bias, device, dtype)
        _mark(self.weight, ShardSpec(1, (part,)))
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        if self.group.size == 1:
            return F.linear(x, self.weight, self.bias)
        y = self.group.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(Embedding):
    """Rows [start, start + rows) of the vocabulary; the last rank's padded with zero rows."""

    def __init__(self, vocab_size: int, dim: int, device: torch.device, dtype: torch.dtype,
                 group: TPGroup) -> None:
        rows = math.ceil(vocab_size / group.size)
        super().__init__(rows, dim, device, dtype)
        self.group = group
        self.vocab_size = vocab_size
        self.start = min(group.rank * rows, vocab_size)
        stop = min(self.start + rows, vocab_size)
        _mark(self.weight, ShardSpec(0, (Part(vocab_size, self.start, stop),),
                                     pad=rows - (stop - self.start)))

    def forward(self, ids: Tensor) -> Tensor:
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.group.all_reduce(x.masked_fill(~mine[:, None], 0))

    def logits(self, x: Tensor, vocab_limit: int | None) -> Tensor:
        """float32 logits [rows, vocab] on rank 0 (other ranks get their own columns).
        Ids >= vocab_limit get -inf and their weight rows are never read."""
        weight = self.weight
        limit = self.vocab_size if vocab_limit is None else vocab_limit
        n = max(0, min(weight.shape[0], limit - self.start))
        if n == weight.shape[0]:
            local = F.linear(x, weight).float()
        else:
            # Skipping the rows that are never sampled saves reading most of a padded head.
            local = x.new_full((x.shape[0], weight.shape[0]), float("-inf"), dtype=torch.float32)
            local[:, :n] = F.linear(x, weight[:n])
        if self.group.size == 1:
            return local
        return self.group.gather_columns(local)[:, : self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: split by vocabulary rows like the embedding, used only for logits."""
