"""The decoder over the CPU kernels; `install_` swaps these modules into a loaded model.

A decoder layer is three kernel calls: norm, QKV projection, RoPE and the cache write
(tl_layer_attn_in); attention (decode rows in tl_decode_attention, prefill chunks in torch's
SDPA); then the output projection with its residual, norm, gate/up with SiLU-and-multiply, and
the down projection with its residual (tl_layer_attn_out_mlp). Between op-by-op calls Python
cost more than the normalisation, RoPE and attention together at batch 1. A batch of decodes
only runs every layer in one call (KernelDecodeStack: tl_forward_decode).

Activations are float32 whatever the weights' dtype; weights are packed once as float32 or
bfloat16 (cpu.pack), or quantized (quant_pack.pack: a GGUF file's blocks as they are, or
weights quantized at load by --quantization). Each replacement keeps the forward signature
of the torch module it replaces (daemon/model/decoder.py).
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from daemon.model.attention import AttentionMetadata, PagedAttention, PrefillSpan
from daemon.model.config import ModelConfig
from daemon.model.decoder import DecoderLayer, DecoderLM, RMSNorm
from daemon.model.kernels import cpu
from daemon.model.kernels.cpu import Kernels
from daemon.model.parallel.layers import Linear

if TYPE_CHECKING:
    from daemon.model.kernels.quant_pack import Blocks


def install_(model: DecoderLM, kernels: Kernels, quantization: str | None = None) -> None:
    """Replace the model's layers, final norm, embedding and head, in place. The weights in
    `model.quantized` are packed as they are (and leave it)."""
    if quantization is not None and quantization not in cpu.QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(cpu.QUANTIZATIONS)} "
                         f"or None, got {quantization!r}")
    kept = model.quantized
    two_term = two_term_rows(quantization, kept)
    model.layers = nn.ModuleList(
        CpuDecoderLayer(cast(DecoderLayer, layer), model.config, kernels, quantization,
                        {k.removeprefix(f"layers.{i}."): v for k, v in kept.items()
                         if k.startswith(f"layers.{i}.")}, two_term)
        for i, layer in enumerate(model.layers))
    model.norm = KernelRMSNorm(model.norm, kernels)  # type: ignore[assignment]
    limit, tied = model.vocab_limit, model.lm_head is None
    name = "embed_tokens.weight" if tied else "lm_head.weight"
    weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    blocks = kept.get(name)
    if blocks is None:
        head = PackedLinear(weight if limit is None else weight[:limit], None, kernels,
                            quantization, two_term_rows=two_term)
    else:
        head = PackedLinear(blocks if limit is None else blocks.rows(slice(0, limit)), None,
                            kernels, two_term_rows=two_term)
    # A tied head serves the embedding lookups too, so the table is held once, packed; with a
    # vocab limit the packed head lacks rows a token id may still name.
    embed = kept.get("embed_tokens.weight")
    source: PackedLinear | Tensor = (
        head if tied and limit is None else model.embed_tokens.weight if embed is None
        else PackedLinear(embed, None, kernels, two_term_rows=two_term))
    model.embed_tokens = KernelEmbedding(source)  # type: ignore[assignment]
    model.lm_head = KernelLMHead(head, model.config.vocab_size)  # type: ignore[assignment]
    model.quantized = {}
    layers = [cast(CpuDecoderLayer, layer) for layer in model.layers]
    if all(isinstance(layer.paged, CpuPagedAttention) for layer in layers):
        model.decode_stack = KernelDecodeStack(layers, model.rotary_of, kernels)
    model.count_rows_as = lambda rows: kernels.quant_set_step_rows(rows or 0)


def two_term_rows(quantization: str | None, kept: dict[str, Blocks]) -> int:
    """Up to how many rows the model's quantized weights take their activations in two terms
    (quant.h), one rule for the whole model, head included: at every row count where its
    layers hold 8-bit codes (--quantization int8, a Q8_0 file), else cpu.TWO_TERM_ROWS. With
    one term past two rows, a Q8_0 file of the real model kept 559 of 572 teacher-forced
    prefill top-1s of float32 on the same weights (97.7%), with two all 572, for 1.25x its
    cold prefill and 1.3-1.4x its decode ticks at 8-64 streams (docs/benchmarks.md)."""
    bits = [b.bits for name, b in kept.items() if name.startswith("layers.")]
    eight = quantization == "int8" or (quantization is None and bool(bits) and min(bits) >= 8)
    return cpu.ALL_ROWS if eight else cpu.TWO_TERM_ROWS


class PackedLinear(nn.Module):
    """A weight packed for tl_linear; forward gives y = (x W^T + bias) * out_scale, float32.
    With gate_up, act(gate) * up (act: a key of cpu.GATED). The weight is a float32 or
    bfloat16 tensor, quantized here when `quantize` names a format (cpu.QUANTIZATIONS),
    or quantized Blocks (quant.h) as a GGUF file held them. two_term_rows: see the function
    of that name (by default, every row count for int8 weights quantized here)."""

    def __init__(self, weight: Tensor | Blocks, bias: Tensor | None, kernels: Kernels,
                 quantize: str | None = None, gate_up: bool = False, act: str = "silu",
                 out_scale: float = 1.0, two_term_rows: int | None = None) -> None:
        super().__init__()
        if isinstance(weight, Tensor) and quantize is not None:
            from daemon.model.kernels import quant_pack  # numpy: only quantized weights need it

            weight = quant_pack.quantize(weight, cpu.QUANTIZATIONS[quantize])
        if not isinstance(weight, Tensor):  # Blocks
            from daemon.model.kernels import quant_pack

            n, n_in = weight.codes.shape[0], weight.inputs
            self.packed, kind = quant_pack.pack(weight, gate_up), weight.kind
            units = -(-n // 2 // cpu.GROUP) if gate_up else -(-n // cpu.UNIT)
        else:
            weight = weight.detach()
            if weight.dtype not in cpu.WEIGHT_TYPES:
                weight = weight.float()
            n, n_in = weight.shape
            self.packed, kind = cpu.pack(weight, gate_up), cpu.WEIGHT_TYPES[weight.dtype]
            units = self.packed.shape[0]
        row_scale = None
        if out_scale != 1.0:  # Granite's residual multiplier rides on the row scales
            row_scale = torch.full((n,), out_scale)
            bias = None if bias is None else bias.detach().float() * out_scale
        self.scale = None if row_scale is None else cpu.pack_vector(row_scale, gate_up)
        self.bias = None if bias is None else cpu.pack_vector(bias.detach(), gate_up)
        two_term = (two_term_rows if two_term_rows is not None
                    else cpu.ALL_ROWS if quantize == "int8" else cpu.TWO_TERM_ROWS)
        self.desc = cpu.Weights(self.packed.data_ptr(), _ptr(self.scale), _ptr(self.bias), units,
                                n_in, n // 2 if gate_up else n, kind,
                                cpu.GATED[act] if gate_up else cpu.STORE, two_term)
        self.kernels = kernels

    @classmethod
    def replacing(cls, linear: Linear, kernels: Kernels, quantize: str | None,
                  gate_up: bool = False, act: str = "silu", out_scale: float = 1.0,
                  blocks: Blocks | None = None, two_term_rows: int | None = None
                  ) -> PackedLinear:
        weight = linear.weight if blocks is None else blocks
        return cls(weight, linear.bias, kernels, quantize, gate_up, act, out_scale,
                   two_term_rows)

    @property
    def quantized(self) -> bool:
        return self.desc.type >= cpu.TL_Q4

    def forward(self, x: Tensor) -> Tensor:
        x = x.float().contiguous()
        y = x.new_empty(x.shape[0], self.desc.n_out)
        self.kernels.linear(x.data_ptr(), x.shape[1], x.shape[0], ctypes.byref(self.desc),
                            y.data_ptr(), self.desc.n_out)
        return y

    def rows(self, ids: Tensor) -> Tensor:
        """Rows `ids` of the weight, float32 (a tied head serving embedding lookups)."""
        if self.quantized:
            ids = ids.to(torch.int64).contiguous()
            out = torch.empty(ids.shape[0], self.desc.n_in)
            self.kernels.quant_rows(ctypes.byref(self.desc), ids.data_ptr(), ids.shape[0],
                                    out.data_ptr())
        else:
            out = cpu.unpack_rows(self.packed, ids, self.desc.n_in).float()
        return out if self.scale is None else out * self.scale[ids][:, None]


class CpuDecoderLayer(nn.Module):
    def __init__(self, layer: DecoderLayer, cfg: ModelConfig, kernels: Kernels,
                 quantize: str | None = None, quantized: dict[str, Blocks] | None = None,
                 two_term_rows: int | None = None) -> None:
        """quantize: a format to quantize float weights into; quantized: this layer's weights
        a GGUF file held quantized, by parameter name in the layer; two_term_rows: see the
        function of that name."""
        super().__init__()
        kept = quantized or {}
        attn, mlp = layer.attn, layer.mlp
        # Granite's residual multiplier scales a branch's output; after its norm if it has one.
        out_norms = [None if n is None else n.scale() * cfg.residual_multiplier
                     for n in (layer.attn_out_norm, layer.mlp_out_norm)]
        o_scale, down_scale = (cfg.residual_multiplier if n is None else 1.0 for n in out_norms)
        packed = functools.partial(PackedLinear.replacing, kernels=kernels, quantize=quantize,
                                   two_term_rows=two_term_rows)
        self.qkv = packed(attn.qkv_proj, blocks=kept.get("attn.qkv_proj.weight"))
        self.o = packed(attn.o_proj, out_scale=o_scale, blocks=kept.get("attn.o_proj.weight"))
        self.gate_up = packed(mlp.gate_up_proj, gate_up=True, act=cfg.hidden_act,
                              blocks=kept.get("mlp.gate_up_proj.weight"))
        self.down = packed(mlp.down_proj, out_scale=down_scale,
                           blocks=kept.get("mlp.down_proj.weight"))
        # Kept referenced: the layer descriptor holds their addresses.
        self.norms = [layer.input_norm.scale(), layer.post_attention_norm.scale(),
                      *(None if n is None else n.scale() for n in (attn.q_norm, attn.k_norm)),
                      *out_norms]
        self.desc = cpu.Layer(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                              layer.input_norm.eps, *map(_ptr, self.norms), self.qkv.desc,
                              self.o.desc, self.gate_up.desc, self.down.desc)
        # The decode kernel works in 16-float vectors; other head sizes keep the reference.
        scale, window = attn.paged.scale, attn.paged.window
        self.paged = (CpuPagedAttention(kernels, scale, window) if cfg.head_dim % 16 == 0
                      else PagedAttention(scale, window))
        self.rope = attn.rope
        self.kernels = kernels
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata) -> Tensor:
        x = x.float().contiguous()  # the residual stream, updated in place below
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        qkv = x.new_empty(x.shape[0], heads + 2 * kv_heads, head_dim)
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        tables = (cos.data_ptr(), sin.data_ptr()) if self.rope else (None, None)
        cache = (kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), cpu.WEIGHT_TYPES[kv_cache.dtype])
        if not meta.prefills and isinstance(self.paged, CpuPagedAttention):  # all decodes
            out = x.new_empty(x.shape[0], heads * head_dim)
            self.kernels.layer_decode(
                ctypes.byref(self.desc), x.data_ptr(), x.shape[0], *tables,
                meta.write_rows.data_ptr(), *cache, *self.paged.decode_args(kv_cache[0], meta),
                qkv.data_ptr(), out.data_ptr())
            return x
        self.kernels.layer_attn_in(ctypes.byref(self.desc), x.data_ptr(), x.shape[0], *tables,
                                   meta.write_rows.data_ptr(), *cache, qkv.data_ptr())
        out = self.paged.attend(qkv[:, :heads], qkv[:, heads : heads + kv_heads],
                                qkv[:, heads + kv_heads :], kv_cache, meta).contiguous()
        self.kernels.layer_attn_out_mlp(ctypes.byref(self.desc), x.data_ptr(), x.shape[0],
                                        out.data_ptr())
        return x


class KernelDecodeStack:
    """Every layer of a batch of decodes in one kernel call (tl_forward_decode), where a call a
    layer cost ~15 us of Python and ctypes each; DecoderLM.forward takes it for such batches.
    Its steps hold each layer's cache addresses, made again when the caches move."""

    def __init__(self, layers: list[CpuDecoderLayer], rotary_of: list[int],
                 kernels: Kernels) -> None:
        self.layers, self.kernels = layers, kernels
        self.ropes = [i if layer.rope else -1 for layer, i in zip(layers, rotary_of, strict=True)]
        self.steps = (cpu.DecodeStep * len(layers))()
        self.caches: tuple[int, ...] = ()
        self.calls = 0  # batches run through the stack (a test's witness)

    def __call__(self, x: Tensor, tables: list[tuple[Tensor, Tensor]], kv_caches: list[Tensor],
                 meta: AttentionMetadata) -> Tensor:
        x = x.float().contiguous()  # the residual stream, updated in place
        first = self.layers[0]
        args = cast(CpuPagedAttention, first.paged).decode_args(kv_caches[0][0], meta)
        self._place(kv_caches, meta)
        cos, sin = ([t[j].float().contiguous() for t in tables] for j in (0, 1))
        qkv = x.new_empty(x.shape[0], (first.heads + 2 * first.kv_heads) * first.head_dim)
        out = x.new_empty(x.shape[0], first.heads * first.head_dim)
        pointers = ctypes.c_void_p * len(tables)
        self.kernels.forward_decode(
            self.steps, len(self.layers), x.data_ptr(), x.shape[0],
            pointers(*(c.data_ptr() for c in cos)), pointers(*(s.data_ptr() for s in sin)),
            meta.write_rows.data_ptr(), cpu.WEIGHT_TYPES[kv_caches[0].dtype], *args[:4],
            qkv.data_ptr(), out.data_ptr())
        self.calls += 1
        return x

    def _place(self, kv_caches: list[Tensor], meta: AttentionMetadata) -> None:
        """Each step's layer, caches, RoPE table, score scale and window."""
        caches = tuple(c.data_ptr() for c in kv_caches)
        if caches == self.caches:
            return
        for step, layer, kv, rope in zip(self.steps, self.layers, kv_caches, self.ropes,
                                         strict=True):
            scale, window = cast(CpuPagedAttention, layer.paged).decode_args(kv[0], meta)[4:]
            step.layer = ctypes.pointer(layer.desc)
            step.k_cache, step.v_cache = kv[0].data_ptr(), kv[1].data_ptr()
            step.rope, step.scale, step.window = rope, scale, window
        self.caches = caches


class KernelRMSNorm(nn.Module):
    def __init__(self, norm: RMSNorm, kernels: Kernels) -> None:
        super().__init__()
        self.weight = norm.scale()
        self.eps = norm.eps
        self.kernels = kernels

    def forward(self, x: Tensor) -> Tensor:
        x = x.float().contiguous()
        y = torch.empty_like(x)
        self.kernels.rmsnorm(x.data_ptr(), x.shape[0], x.shape[1], self.weight.data_ptr(),
                             self.eps, y.data_ptr())
        return y


class KernelEmbedding(nn.Module):
    def __init__(self, source: PackedLinear | Tensor) -> None:
        super().__init__()
        self.source = source

    def forward(self, ids: Tensor) -> Tensor:
        if isinstance(self.source, PackedLinear):
            return self.source.rows(ids)
        return self.source[ids].float()


class KernelLMHead(nn.Module):
    """The head `DecoderLM.compute_logits` calls; packed with the vocab limit's rows only."""

    def __init__(self, head: PackedLinear, vocab_size: int) -> None:
        super().__init__()
        self.head, self.vocab_size = head, vocab_size

    def logits(self, x: Tensor, vocab_limit: int | None) -> Tensor:
        """float32 logits [rows, vocab]; ids >= vocab_limit get -inf."""
        if vocab_limit is None:
            return self.head(x)
        logits = x.new_full((x.shape[0], self.vocab_size), float("-inf"), dtype=torch.float32)
        logits[:, :vocab_limit] = self.head(x)
        return logits


class CpuPagedAttention(PagedAttention):
    """Decode rows and prefill chunks read the cache blocks in place (tl_decode_attention,
    tl_prefill_attention)."""

    def __init__(self, kernels: Kernels, scale: float | None = None,
                 window: int | None = None) -> None:
        super().__init__(scale, window)
        self.kernels = kernels

    def decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor,
               meta: AttentionMetadata) -> Tensor:
        tables, width, lens, block_size, scale, window = self.decode_args(k_cache, meta)
        num_seqs, num_heads, head_dim = q.shape
        if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.float().contiguous()
        out = q.new_empty(num_seqs, num_heads, head_dim)
        self.kernels.decode_attention(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            cpu.WEIGHT_TYPES[k_cache.dtype], tables, width, lens, num_seqs, num_heads,
            k_cache.shape[1], head_dim, block_size, scale, window, out.data_ptr())
        return out

    def decode_args(self, k_cache: Tensor, meta: AttentionMetadata
                    ) -> tuple[int, int, int, int, float, int]:
        """tl_decode_attention's block tables, their width, the context lengths, the cache's
        block size, the score scale and the window (0: none)."""
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        assert tables is not None and lens is not None
        head_dim = k_cache.shape[-1]
        scale = 1.0 / math.sqrt(head_dim) if self.scale is None else self.scale
        return (tables.data_ptr(), tables.shape[1], lens.data_ptr(), k_cache.shape[2], scale,
                self.window or 0)

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                span: PrefillSpan) -> Tensor:
        """The chunk's queries over every key they see, read from the cache blocks in place
        (tl_prefill_attention: the cached prefix and the chunk's own keys, causal, in one
        pass). Torch's CPU flash kernel, two calls merged by their log-sum-exps after a gather
        of the prefix, took ~60% of a cold SmolLM2 prefill in bfloat16."""
        num_tokens, num_heads, head_dim = q.shape
        if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.float().contiguous()
        block_ids = span.block_ids.to(torch.int64).contiguous()
        scale = 1.0 / math.sqrt(head_dim) if self.scale is None else self.scale
        out = q.new_empty(num_tokens, num_heads, head_dim)
        self.kernels.prefill_attention(
            q.data_ptr(), q.stride(0), num_tokens, k_cache.data_ptr(), v_cache.data_ptr(),
            cpu.WEIGHT_TYPES[k_cache.dtype], block_ids.data_ptr(), span.context_len, num_heads,
            k_cache.shape[1], head_dim, k_cache.shape[2], scale, self.window or 0,
            out.data_ptr())
        return out


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
