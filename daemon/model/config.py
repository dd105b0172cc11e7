"""Model hyper-parameters, read from a Hugging Face ``config.json`` or built in code.

Only what the decoder needs is kept. Anything in the HF config that would change the maths
and that the decoder does not implement is refused here, naming the field, rather than
silently producing a model that computes something else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")


class ConfigError(ValueError):
    """A config.json the decoder cannot run; the message names the field."""


@dataclasses.dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear"|"llama3", ...}
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = dataclasses.field(default_factory=list)
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v only
    o_bias: bool = False  # Llama's attention_bias puts one on o_proj as well
    # Attention is always full; a sliding-window model is exact up to this many tokens.
    sliding_window: int | None = None
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        _check_rope_scaling(self.rope_scaling)

    @property
    def max_model_len(self) -> int:
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        arch = _architecture(raw)
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
        if raw.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not supported")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads"):
            if not isinstance(raw.get(name), int):
                raise ConfigError(f"{name} is missing or not an integer")
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        theta, scaling = _rope(raw)
        qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_id_list(raw.get("eos_token_id")),
            qkv_bias=qwen2 or bool(raw.get("attention_bias", False)),
            o_bias=not qwen2 and bool(raw.get("attention_bias", False)),
            sliding_window=_sliding_window(raw, qwen2),
            architecture=arch,
        )


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not archs:
        model_type = raw.get("model_type")
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                   "qwen2": "Qwen2ForCausalLM"}
        if model_type in by_type:
            return by_type[model_type]
        raise ConfigError(f"architectures is missing and model_type {model_type!r} is unknown")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"architecture {arch!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return str(arch)


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 writes rope_parameters (theta inside); older versions write
    # rope_theta + rope_scaling.
    params = raw.get("rope_parameters") or raw.get("rope_scaling")
    theta = float(raw.get("rope_theta", 10000.0))
    if not params:
        return theta, None
    params = dict(params)
    theta = float(params.pop("rope_theta", theta))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def _check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope_scaling type {rope_type!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    needed = ("factor",) if rope_type == "linear" else _LLAMA3_ROPE_KEYS
    for key in needed:
        if not isinstance(scaling.get(key), int | float):
            raise ConfigError(f"rope_scaling.{key} is missing for rope type {rope_type!r}")


def _sliding_window(raw: dict[str, Any], qwen2: bool) -> int | None:
    window = raw.get("sliding_window")
    if qwen2 and not raw.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def _id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
