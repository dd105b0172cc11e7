"""GGUF files (llama.cpp's format, as Ollama and LM Studio hold models) read with the `gguf`
package: the metadata as the Hugging Face config.json it stands for (so config.py checks a
GGUF file exactly as it checks a checkpoint), the tokenizer's keys (gguf_tokenizer.py), the
sampling defaults, and the tensors dequantized to float32 in Hugging Face's layout.

Tensors are dequantized at load (computing on quantized blocks is a kernel's work, not a
loader's). llama.cpp's converter permutes a Llama-arch model's q/k rows for its interleaved
RoPE and bakes Gemma's unit offset into its norms; both are undone here, as transformers' own
GGUF loader undoes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from daemon.model.kernels import quant_pack
from daemon.model.kernels.quant_pack import Blocks

# general.architecture -> the transformers class config.py knows it by.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM"}
_PERMUTED_QK = ("llama", "granite")  # the converter's LlamaModel permutes their q/k rows
_FUSED = ("phi3",)  # attn_qkv and a gate+up ffn_up, as Phi-3's checkpoints hold them
Q = gguf.GGMLQuantizationType
TENSOR_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K,
                Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Tensors a file may hold that the decoder reads otherwise (Phi-3's LongRoPE factors go into the
# config), or not at all.
_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# general.sampling.* -> SamplingParams' field (llama.cpp's names for a model's recommended
# sampling, written by its converter from generation_config.json).
SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                 "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                 "general.sampling.penalty_repeat": "repetition_penalty"}


class GGUFError(ValueError):
    """The file is not a GGUF file tether can serve; the message names the key or tensor."""


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: itself, or the one .gguf in a folder without a config.json
    (a checkpoint folder); None when it names none. Several .gguf files in one folder are an
    error naming them, since nothing says which to serve."""
    if path.is_file():
        return path if path.suffix == ".gguf" or _has_magic(path) else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise GGUFError(f"{path}: holds {len(files)} .gguf files "
                        f"({', '.join(f.name for f in files)}); give --model one of them")
    return files[0] if files else None


def _has_magic(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


class GGUFFile:
    """One opened file; every error names the file and the key or tensor at fault."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not _has_magic(path):
            raise GGUFError(f"{path}: not a GGUF file (it does not start with the bytes 'GGUF')")
        try:
            self.reader = gguf.GGUFReader(path)
        except (ValueError, IndexError, TypeError, OSError) as e:
            # A tensor's data past the end of the file, a string past it, a type id no GGUF
            # version defines: the reader fails on them as it meets them.
            raise GGUFError(f"{path}: truncated or corrupt GGUF file ({e})") from e
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.string("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise GGUFError(f"{path}: general.architecture {self.arch!r} is not supported "
                            f"(supported: {', '.join(ARCHITECTURES)})")
        for tensor in self.reader.tensors:
            if tensor.tensor_type not in TENSOR_TYPES:
                raise GGUFError(f"{path}: tensor {tensor.name!r} is of type "
                                f"{tensor.tensor_type.name}, which is not supported (supported: "
                                f"{', '.join(t.name for t in TENSOR_TYPES)})")

    # ---- metadata

    def get(self, key: str) -> Any:
        """The value of `key` (str, int, float, bool or a list of them); None when absent."""
        field = self.reader.fields.get(key)
        return None if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return value

    def string(self, key: str) -> str:
        value = self.require(key)
        if not isinstance(value, str):
            raise GGUFError(f"{self.path}: metadata key {key!r} must be a string")
        return value

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.get(key) if default is not None else self.require(key)
        if value is None:
            return int(default or 0)
        if isinstance(value, list):  # per-layer values (OpenELM's head counts)
            raise GGUFError(f"{self.path}: metadata key {key!r} holds one value per layer, "
                            "which is not supported")
        if isinstance(value, bool) or not isinstance(value, int):
            raise GGUFError(f"{self.path}: metadata key {key!r} must be an integer")
        return value

    def number(self, key: str, default: float | None = None) -> float:
        value = self.get(key) if default is not None else self.require(key)
        if value is None:
            return float(default or 0.0)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise GGUFError(f"{self.path}: metadata key {key!r} must be a number")
        return float(value)

    @property
    def name(self) -> str:
        """The model's id for clients: the file's name without .gguf, which says what a user
        chose (SmolLM2-135M-Instruct.Q4_1) where general.name may not ('Smollm2 135M 8k ...')."""
        return self.path.name.removesuffix(".gguf")

    def sampling_defaults(self) -> dict[str, float | int]:
        """The model's recommended sampling (general.sampling.*), by SamplingParams field."""
        out: dict[str, float | int] = {}
        for key, field in SAMPLING_KEYS.items():
            if self.get(key) is not None:
                out[field] = self.integer(key) if field == "top_k" else self.number(key)
        return out

    # ---- config

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The config.json this file's metadata stands for (`vocab_size`: its token count, for
        files without {arch}.vocab_size)."""
        a = self.arch
        heads = self.integer(f"{a}.attention.head_count")
        hidden = self.integer(f"{a}.embedding_length")
        head_dim = self.integer(f"{a}.attention.key_length", hidden // heads)
        for key in (f"{a}.attention.value_length", f"{a}.rope.dimension_count"):
            if self.integer(key, head_dim) != head_dim:
                raise GGUFError(f"{self.path}: {key} is {self.integer(key)}, not the head size "
                                f"{head_dim} (partial rotary or unequal key/value heads are not "
                                "supported)")
        raw: dict[str, Any] = {
            "architectures": [ARCHITECTURES[a]],
            "vocab_size": self.integer(f"{a}.vocab_size", vocab_size),
            "hidden_size": hidden,
            "intermediate_size": self.integer(f"{a}.feed_forward_length"),
            "num_hidden_layers": self.integer(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self.integer(f"{a}.attention.head_count_kv", heads),
            "head_dim": head_dim,
            "rms_norm_eps": self.number(f"{a}.attention.layer_norm_rms_epsilon"),
            "max_position_embeddings": self.integer(f"{a}.context_length"),
            "rope_theta": self.number(f"{a}.rope.freq_base", 10000.0),
            "rope_scaling": self._rope_scaling(),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": a != "qwen2" and "blk.0.attn_q.bias" in self.tensors,
        }
        softcap = self.get(f"{a}.attn_logit_softcapping")
        if softcap is not None:  # config.py refuses it, naming it
            raw["attn_logit_softcapping"] = softcap
        raw.update(self._family(a, heads, hidden, head_dim))
        return raw

    def _rope_scaling(self) -> dict[str, Any] | None:
        a = self.arch
        kind = self.get(f"{a}.rope.scaling.type")
        if "rope_factors_long.weight" in self.tensors:  # Phi-3's LongRoPE
            return {"rope_type": "longrope",
                    "long_factor": self.dequantized("rope_factors_long.weight").tolist(),
                    "short_factor": self.dequantized("rope_factors_short.weight").tolist()}
        if "rope_freqs.weight" in self.tensors:
            raise GGUFError(f"{self.path}: tensor 'rope_freqs.weight' (RoPE frequency factors, "
                            "Llama 3.1's scaling) is not supported")
        if kind in (None, "none"):
            return None
        if kind not in ("linear", "yarn"):
            raise GGUFError(f"{self.path}: {a}.rope.scaling.type {kind!r} is not supported "
                            "(supported: none, linear, yarn)")
        out: dict[str, Any] = {"rope_type": kind,
                               "factor": self.number(f"{a}.rope.scaling.factor")}
        if kind == "yarn":
            out["original_max_position_embeddings"] = self.integer(
                f"{a}.rope.scaling.original_context_length")
        return out

    def _family(self, a: str, heads: int, hidden: int, head_dim: int) -> dict[str, Any]:
        """What the other families' configs say that Llama's does not."""
        if a == "gemma3":
            # llama.cpp fixes what Gemma 3's GGUF files do not say: every 6th layer global, local
            # RoPE base 10k, queries scaled by the head size (the 62-layer 27B's by hidden/heads).
            layers = self.integer(f"{a}.block_count")
            return {"sliding_window": self.integer(f"{a}.attention.sliding_window"),
                    "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0,
                    "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
                    "final_logit_softcapping": self.get(f"{a}.final_logit_softcapping")}
        if a == "phi3":
            window = self.get(f"{a}.attention.sliding_window")
            original = self.get(f"{a}.rope.scaling.original_context_length")
            return {"sliding_window": window or None,
                    "original_max_position_embeddings": original
                    or self.integer(f"{a}.context_length")}
        if a == "granite":
            return {"attention_multiplier": self.number(f"{a}.attention.scale", 1.0),
                    "embedding_multiplier": self.number(f"{a}.embedding_scale", 1.0),
                    "residual_multiplier": self.number(f"{a}.residual_scale", 1.0),
                    "logits_scaling": self.number(f"{a}.logit_scale", 1.0)}
        return {}

    # ---- tensors

    @property
    def fused(self) -> bool:
        return self.arch in _FUSED

    def hf_name_to_gguf(self) -> gguf.TensorNameMap:
        arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == self.arch)
        return gguf.get_tensor_name_map(arch, self.integer(f"{self.arch}.block_count"))

    def unused(self, used: set[str]) -> Iterator[str]:
        """The file's tensors nothing reads (the head of a tied model is read as nothing)."""
        for name in self.tensors:
            if name not in used and name not in _CONFIG_TENSORS:
                yield name

    def dequantized(self, name: str, num_heads: int = 0) -> np.ndarray:
        """Tensor `name` as float32 in Hugging Face's layout [out, in]; `num_heads`: the heads
        its rows hold, for the q/k weights llama.cpp permuted."""
        tensor = self.tensors[name]
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except (ValueError, NotImplementedError) as e:
            raise GGUFError(f"{self.path}: tensor {name!r} cannot be dequantized: {e}") from e
        values = np.require(values, np.float32, ["W"])  # F32 tensors are views of the file
        if num_heads and self.arch in _PERMUTED_QK:
            values = _unpermute(values, num_heads)
        if self.arch == "gemma3" and name.endswith("norm.weight"):
            values = values - 1.0  # the converter added Gemma's unit offset
        return values


    def blocks(self, name: str, num_heads: int = 0) -> Blocks | None:
        """Tensor `name` as quantized blocks (quant_pack) in Hugging Face's row order, as the
        CPU kernels compute on them; None for a float type."""
        tensor = self.tensors[name]
        if tensor.tensor_type not in quant_pack.QUANTIZED_TYPES or len(tensor.data.shape) != 2:
            return None
        rows = tensor.data.shape[0]
        try:
            out = quant_pack.from_gguf(tensor.data, tensor.tensor_type, rows)
        except ValueError as e:
            raise GGUFError(f"{self.path}: tensor {name!r}: {e}") from e
        if num_heads and self.arch in _PERMUTED_QK:
            out = out.rows(_unpermute(np.arange(rows), num_heads))
        return out


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes convert_hf_to_gguf.py's LlamaModel.permute: per head, llama.cpp's interleaved
    (x0, y0, x1, y1, ...) rows back to Hugging Face's rotate-half (x0, x1, ..., y0, y1, ...)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
