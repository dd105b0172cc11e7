"""What each family's GGUF file says, and how: its metadata as the Hugging Face config.json it
stands for (so config.py checks a GGUF file exactly as it checks a checkpoint), and what
llama.cpp's converter did to its tensors, undone here as transformers' GGUF loader undoes it
(a Llama-arch model's q/k rows permuted for interleaved RoPE, Gemma's unit offset baked into
its norms, Phi-3's fused projections kept fused).

Metadata that would change the maths and that is not read here is refused, naming the key.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from daemon.model.gguf_file import GGUFError, GGUFFile
from daemon.model.kernels import quant_pack
from daemon.model.kernels.quant_pack import Blocks

# general.architecture -> the transformers class config.py knows it by.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM"}
_PERMUTED_QK = ("llama", "granite")  # the converter's LlamaModel permutes their q/k rows
FUSED = ("phi3",)  # attn_qkv and a gate+up ffn_up, as Phi-3's checkpoints hold them
# Tensors the decoder reads as configuration: RoPE's per-frequency factors (Phi-3's LongRoPE,
# Llama 3.1's rope_freqs).
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")
# {arch}.rope.scaling.* keys of YaRN -> rope_scaling's names for them.
_YARN_KEYS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow",
              "yarn_attn_factor": "attention_factor"}


def check_architecture(file: GGUFFile) -> str:
    if file.arch not in ARCHITECTURES:
        raise GGUFError(f"{file.path}: general.architecture {file.arch!r} is not supported "
                        f"(supported: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[file.arch]


def hf_config(file: GGUFFile) -> dict[str, Any]:
    """The config.json the file's metadata stands for."""
    architecture, a = check_architecture(file), file.arch
    heads = file.integer(f"{a}.attention.head_count")
    hidden = file.integer(f"{a}.embedding_length")
    head_dim = file.integer(f"{a}.attention.key_length", hidden // heads)
    for key in (f"{a}.attention.value_length", f"{a}.rope.dimension_count"):
        if file.integer(key, head_dim) != head_dim:
            raise GGUFError(f"{file.path}: {key} is {file.integer(key)}, not the head size "
                            f"{head_dim} (partial rotary or unequal key/value heads are not "
                            "supported)")
    tokens = file.get(f"{a}.vocab_size")
    raw: dict[str, Any] = {
        "architectures": [architecture],
        "vocab_size": file.integer(f"{a}.vocab_size") if tokens is not None
        else len(file.require("tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": file.integer(f"{a}.feed_forward_length"),
        "num_hidden_layers": file.integer(f"{a}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": file.integer(f"{a}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": file.number(f"{a}.attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": file.integer(f"{a}.context_length"),
        "rope_theta": file.number(f"{a}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(file, head_dim),
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "attention_bias": a != "qwen2" and "blk.0.attn_q.bias" in file.tensors,
    }
    softcap = file.get(f"{a}.attn_logit_softcapping")
    if softcap is not None:  # config.py refuses it, naming it
        raw["attn_logit_softcapping"] = softcap
    raw.update(_family(file, heads, hidden, head_dim))
    return raw


def _rope_scaling(file: GGUFFile, head_dim: int) -> dict[str, Any] | None:
    a = file.arch
    kind = file.get(f"{a}.rope.scaling.type")
    if "rope_factors_long.weight" in file.tensors:  # Phi-3's LongRoPE
        out: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": _factors(file, "rope_factors_long.weight", head_dim),
            "short_factor": _factors(file, "rope_factors_short.weight", head_dim)}
        if file.get(f"{a}.rope.scaling.attn_factor") is not None:
            out["attention_factor"] = file.number(f"{a}.rope.scaling.attn_factor")
        return out
    if "rope_freqs.weight" in file.tensors:
        # Each frequency's divisor, which llama.cpp's converter computes from Llama 3.1's
        # rope_scaling (the llama3 type) and writes in its place.
        if kind not in (None, "none"):
            raise GGUFError(f"{file.path}: tensor 'rope_freqs.weight' with {a}.rope.scaling.type "
                            f"{kind!r} is not supported (only with none)")
        return {"rope_type": "freq_factors",
                "factors": _factors(file, "rope_freqs.weight", head_dim)}
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise GGUFError(f"{file.path}: {a}.rope.scaling.type {kind!r} is not supported "
                        "(supported: none, linear, yarn)")
    out = {"rope_type": kind, "factor": file.number(f"{a}.rope.scaling.factor")}
    if kind == "yarn":
        out["original_max_position_embeddings"] = file.integer(
            f"{a}.rope.scaling.original_context_length")
        for key, name in _YARN_KEYS.items():
            if file.get(f"{a}.rope.scaling.{key}") is not None:
                out[name] = file.number(f"{a}.rope.scaling.{key}")
        # llama.cpp's extrapolation mix; 1 is what YaRN computes, and nothing else is built.
        if file.number(f"{a}.rope.scaling.yarn_ext_factor", 1.0) != 1.0:
            raise GGUFError(f"{file.path}: {a}.rope.scaling.yarn_ext_factor "
                            f"{file.number(f'{a}.rope.scaling.yarn_ext_factor')} is not "
                            "supported (only 1.0)")
    return out


def _factors(file: GGUFFile, name: str, head_dim: int) -> list[float]:
    """A tensor of one RoPE factor per frequency: head_dim / 2 of them."""
    if name not in file.tensors:
        raise GGUFError(f"{file.path}: tensor {name!r} is missing (LongRoPE needs both lists)")
    if file.shape(name) != (head_dim // 2,):
        raise GGUFError(f"{file.path}: tensor {name!r} has shape {file.shape(name)}, the head "
                        f"size {head_dim} implies ({head_dim // 2},)")
    return [float(v) for v in file.dequantized(name)]


def _family(file: GGUFFile, heads: int, hidden: int, head_dim: int) -> dict[str, Any]:
    """What the other families' configs say that Llama's does not."""
    a = file.arch
    if a == "gemma3":
        # llama.cpp fixes what Gemma 3's GGUF files do not say: every 6th layer global, local
        # RoPE base 10k, queries scaled by the head size (the 62-layer 27B's by hidden/heads).
        layers = file.integer(f"{a}.block_count")
        return {"sliding_window": file.integer(f"{a}.attention.sliding_window"),
                "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0,
                "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
                "final_logit_softcapping": file.get(f"{a}.final_logit_softcapping")}
    if a == "phi3":
        window = file.get(f"{a}.attention.sliding_window")
        original = file.get(f"{a}.rope.scaling.original_context_length")
        return {"sliding_window": window or None,  # 0: none (Phi-4)
                "original_max_position_embeddings": original
                or file.integer(f"{a}.context_length")}
    if a == "granite":
        return {"attention_multiplier": file.number(f"{a}.attention.scale", 1.0),
                "embedding_multiplier": file.number(f"{a}.embedding_scale", 1.0),
                "residual_multiplier": file.number(f"{a}.residual_scale", 1.0),
                "logits_scaling": file.number(f"{a}.logit_scale", 1.0)}
    return {}


def unconverted(file: GGUFFile, name: str, num_heads: int = 0) -> np.ndarray:
    """Tensor `name` as the family's Hugging Face checkpoint holds it, float32 [out, in];
    `num_heads`: the heads its rows hold, for the q/k weights llama.cpp permuted."""
    values = file.dequantized(name)
    if num_heads and file.arch in _PERMUTED_QK:
        values = _unpermute(values, num_heads)
    if file.arch == "gemma3" and name.endswith("norm.weight"):
        values = values - 1.0  # the converter added Gemma's unit offset
    return values


def unconverted_blocks(file: GGUFFile, name: str, num_heads: int = 0) -> Blocks | None:
    """Tensor `name` as quantized blocks (quant_pack) in Hugging Face's row order, as the CPU
    kernels compute on them; None for a float type or a tensor that is not a matrix."""
    tensor = file.tensors[name]
    if tensor.tensor_type not in quant_pack.QUANTIZED_TYPES or len(tensor.data.shape) != 2:
        return None
    rows = tensor.data.shape[0]
    try:
        out = quant_pack.from_gguf(tensor.data, tensor.tensor_type, rows)
    except ValueError as e:
        raise GGUFError(f"{file.path}: tensor {name!r}: {e}") from e
    if num_heads and file.arch in _PERMUTED_QK:
        out = out.rows(_unpermute(np.arange(rows), num_heads))
    return out


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes convert_hf_to_gguf.py's LlamaModel.permute: per head, llama.cpp's interleaved
    (x0, y0, x1, y1, ...) rows back to Hugging Face's rotate-half (x0, x1, ..., y0, y1, ...)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
