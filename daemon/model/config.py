"""Model hyper-parameters, read from a Hugging Face ``config.json`` or built in code.

Only what the decoder needs is kept. Anything in the HF config that would change the maths
and that the decoder does not implement is refused here, naming the field, rather than
silently producing a model that computes something else. Where a field is absent, the
family's transformers config class supplies the default (`_DEFAULTS`), as it does there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# architecture -> the model_type a config.json without `architectures` names it by
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
               "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
               "Gemma3ForCausalLM": "gemma3_text", "Phi3ForCausalLM": "phi3",
               "SmolLM3ForCausalLM": "smollm3", "GraniteForCausalLM": "granite"}
SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPES)
# freq_factors: each frequency divided by its own factor, as llama.cpp applies a GGUF file's
# rope_freqs tensor (Llama 3.1's llama3 scaling, computed ahead by its converter).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "freq_factors")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")
_DEFAULTS: dict[str, dict[str, Any]] = {  # the config classes' defaults that differ from Llama's
    "MistralForCausalLM": {"sliding_window": 4096},
    "Qwen2ForCausalLM": {"max_window_layers": 28},
    "Qwen3ForCausalLM": {"head_dim": 128, "max_window_layers": 28, "sliding_window": 4096},
    "Gemma3ForCausalLM": {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                          "query_pre_attn_scalar": 256, "sliding_window": 4096,
                          "sliding_window_pattern": 6, "rope_theta": 1e6,
                          "rope_local_base_freq": 1e4, "tie_word_embeddings": True,
                          "max_position_embeddings": 131072},
    "Phi3ForCausalLM": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
                        "original_max_position_embeddings": 4096},
    "SmolLM3ForCausalLM": {"rope_theta": 2e6, "tie_word_embeddings": True,
                           "no_rope_layer_interval": 4},
}
_SLIDING_FLAG = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM")  # use_sliding_window


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
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear"|"llama3"|..., ...}
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048  # the positions served (YaRN: the extended context)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = dataclasses.field(default_factory=list)
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v only
    o_bias: bool = False  # Llama's attention_bias puts one on o_proj as well
    # Per layer "full_attention" or "sliding_attention" ([] = all full). A sliding layer's
    # query sees only the last `sliding_window` keys, itself included.
    layer_types: list[str] = dataclasses.field(default_factory=list)
    sliding_window: int | None = None
    # Sliding layers' own RoPE (Gemma 3's rope_local_base_freq); None = the global one.
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict[str, Any] | None = None
    rope_layers: list[bool] = dataclasses.field(default_factory=list)  # [] = RoPE everywhere
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each query and key head
    norm_unit_offset: bool = False  # Gemma: norms scale by (1 + weight), in float32
    sandwich_norms: bool = False  # Gemma 3: attention and MLP outputs normed before the residual
    hidden_act: str = "silu"
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden), in the weights' dtype
    embedding_multiplier: float = 1.0  # Granite's multipliers
    residual_multiplier: float = 1.0
    attention_scale: float | None = None  # None = 1 / sqrt(head_dim)
    logits_scaling: float = 1.0  # logits are divided by it
    final_logit_softcapping: float | None = None
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (only "
                              f"{', '.join(map(repr, SUPPORTED_ACTIVATIONS))})")
        self.layer_types = self.layer_types or ["full_attention"] * self.num_layers
        self.rope_layers = self.rope_layers or [True] * self.num_layers
        for name in ("layer_types", "rope_layers"):
            if len(getattr(self, name)) != self.num_layers:
                raise ConfigError(f"{name} has {len(getattr(self, name))} entries for "
                                  f"{self.num_layers} layers")
        unknown = set(self.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ConfigError(f"layer_types {sorted(unknown)} are not supported "
                              f"(only {', '.join(LAYER_TYPES)})")
        for scaling in (self.rope_scaling, self.sliding_rope_scaling):
            _check_rope_scaling(scaling, self.head_dim)

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, None where it attends to the whole context."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def rope_of(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """(theta, scaling) of the RoPE `layer` applies."""
        sliding = self.layer_types[layer] == "sliding_attention"
        if sliding and self.sliding_rope_theta is not None:
            return self.sliding_rope_theta, self.sliding_rope_scaling
        return self.rope_theta, self.rope_scaling

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        arch = _architecture(raw)
        raw = {**_DEFAULTS.get(arch, {}), **raw}
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads"):
            if not isinstance(raw.get(name), int):
                raise ConfigError(f"{name} is missing or not an integer")
        _refuse_unbuilt(raw)
        num_heads = raw["num_attention_heads"]
        theta, scaling = _rope(raw, arch)
        bias = bool(raw.get("attention_bias", False))
        qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=_positions(raw, scaling),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_id_list(raw.get("eos_token_id")),
            qkv_bias=qwen2 or bias,
            o_bias=not qwen2 and bias,
            architecture=arch,
            hidden_act=_activation(raw, arch),
            **_attention_layers(raw, arch),
            **_family_maths(raw, arch),
        )


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not archs:
        model_type = raw.get("model_type")
        by_type = {t: a for a, t in MODEL_TYPES.items()}
        if model_type in by_type:
            return by_type[model_type]
        raise ConfigError(f"architectures is missing and model_type {model_type!r} is unknown")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"architecture {arch!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return str(arch)


def _refuse_unbuilt(raw: dict[str, Any]) -> None:
    if raw.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not supported")
    # transformers' Gemma 3 passes no softcap to its attention either; refused, not ignored.
    if raw.get("attn_logit_softcapping") is not None:
        raise ConfigError("attn_logit_softcapping is not supported (attention logit "
                          "soft-capping)")
    if raw.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention=true is not supported")


def _activation(raw: dict[str, Any], arch: str) -> str:
    field = "hidden_activation" if arch == "Gemma3ForCausalLM" else "hidden_act"
    act = raw.get(field, "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(f"{field} {act!r} is not supported (only "
                          f"{', '.join(map(repr, SUPPORTED_ACTIVATIONS))})")
    return str(act)


def _attention_layers(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """Which layers slide and with what window, which apply RoPE, and the sliding layers' RoPE."""
    n = raw["num_hidden_layers"]
    window = raw.get("sliding_window") or None
    if arch in _SLIDING_FLAG and not raw.get("use_sliding_window", False):
        window = None
    rope_layers = [bool(v) for v in raw.get("no_rope_layers") or []]  # SmolLM3: 1 = RoPE
    for field in ("no_rope_layers", "layer_types"):
        if raw.get(field) and len(raw[field]) != n:
            raise ConfigError(f"{field} has {len(raw[field])} entries for num_hidden_layers {n}")
    if arch == "SmolLM3ForCausalLM" and not rope_layers:
        interval = raw["no_rope_layer_interval"]
        rope_layers = [(i + 1) % interval != 0 for i in range(n)]
    types = raw.get("layer_types")
    if arch in ("LlamaForCausalLM", "GraniteForCausalLM"):  # no sliding attention in these
        window, types = None, None
    elif arch in ("MistralForCausalLM", "Phi3ForCausalLM"):  # every layer, whatever it says
        types = ["sliding_attention"] * n
    elif not types and arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = raw["max_window_layers"]
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    elif not types and arch == "SmolLM3ForCausalLM":
        types = ["full_attention" if rope else "sliding_attention" for rope in rope_layers]
    elif not types and arch == "Gemma3ForCausalLM":
        every = raw["sliding_window_pattern"]
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    out: dict[str, Any] = {"layer_types": list(types or []),
                           "sliding_window": int(window) if window else None,
                           "rope_layers": rope_layers}
    if arch == "Gemma3ForCausalLM":
        out["sliding_rope_theta"], out["sliding_rope_scaling"] = _sliding_rope(raw)
    return out


def _family_maths(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """What Qwen3, Gemma 3 and Granite compute differently from Llama."""
    if arch == "Qwen3ForCausalLM":
        return {"qk_norm": True}
    if arch == "Gemma3ForCausalLM":
        return {"qk_norm": True, "norm_unit_offset": True, "sandwich_norms": True,
                "scale_embeddings": True,
                "attention_scale": float(raw["query_pre_attn_scalar"]) ** -0.5,
                "final_logit_softcapping": _number(raw.get("final_logit_softcapping"))}
    if arch == "GraniteForCausalLM":
        return {"embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)),
                "residual_multiplier": float(raw.get("residual_multiplier", 1.0)),
                "attention_scale": float(raw.get("attention_multiplier", 1.0)),
                "logits_scaling": float(raw.get("logits_scaling", 1.0))}
    return {}


# ---- RoPE


def _rope(raw: dict[str, Any], arch: str) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 writes rope_parameters (theta inside; Gemma 3 one per layer type);
    # older versions write rope_theta + rope_scaling.
    params = raw.get("rope_parameters") or raw.get("rope_scaling")
    if params and "full_attention" in params:
        params = params["full_attention"]
    return _rope_params(raw, params, float(raw.get("rope_theta", 10000.0)), arch)


def _sliding_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters") or {}
    local = params.get("sliding_attention") if "sliding_attention" in params else None
    return _rope_params(raw, local, float(raw["rope_local_base_freq"]), "Gemma3ForCausalLM")


def _rope_params(raw: dict[str, Any], params: dict[str, Any] | None, theta: float,
                 arch: str) -> tuple[float, dict[str, Any] | None]:
    if not params:
        return theta, None
    params = dict(params)
    theta = float(params.pop("rope_theta", theta))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = params.pop("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ConfigError(f"partial_rotary_factor {partial} is not supported (only 1.0)")
    # Phi-3's first long-context configs called LongRoPE "su"; Phi3Config reads "yarn" as it too.
    if rope_type == "su" or (rope_type == "yarn" and arch == "Phi3ForCausalLM"):
        rope_type = "longrope"
    if rope_type == "default":
        return theta, None
    if rope_type in ("yarn", "longrope"):
        # transformers gives a top-level original_max_position_embeddings (Phi-3's) priority.
        original = (raw.get("original_max_position_embeddings")
                    or params.get("original_max_position_embeddings")
                    or raw.get("max_position_embeddings", 2048))
        params["original_max_position_embeddings"] = int(original)
    if rope_type == "longrope" and params.get("factor") is None:
        params["factor"] = raw.get("max_position_embeddings", 2048) / int(original)
    return theta, {"rope_type": rope_type, **params}


def _positions(raw: dict[str, Any], scaling: dict[str, Any] | None) -> int:
    """max_position_embeddings; YaRN extends the original context by its factor (as vLLM
    reads a Qwen2.5 long-context config: 32k original, factor 4, 128k served)."""
    positions = int(raw.get("max_position_embeddings", 2048))
    factor = (scaling or {}).get("factor")
    if scaling is not None and scaling["rope_type"] == "yarn" and isinstance(factor, int | float):
        positions = max(positions,
                        math.floor(scaling["original_max_position_embeddings"] * factor))
    return positions


def _check_rope_scaling(scaling: dict[str, Any] | None, head_dim: int) -> None:
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope_scaling type {rope_type!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    needed = {"linear": ("factor",), "llama3": _LLAMA3_ROPE_KEYS, "yarn": ("factor",),
              "longrope": (), "freq_factors": ()}[rope_type]
    for key in needed:
        if not isinstance(scaling.get(key), int | float):
            raise ConfigError(f"rope_scaling.{key} is missing for rope type {rope_type!r}")
    lists = {"longrope": ("short_factor", "long_factor"), "freq_factors": ("factors",)}
    for key in lists.get(rope_type, ()):
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != head_dim // 2:
            raise ConfigError(f"rope_scaling.{key} must list head_dim / 2 = "
                              f"{head_dim // 2} numbers for rope type {rope_type!r}")


def _number(value: float | None) -> float | None:
    return None if value is None else float(value)


def _id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
