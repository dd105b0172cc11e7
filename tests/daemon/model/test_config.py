"""config.json as each family writes it, the older formats too, and what is refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from daemon.model.config import ConfigError, ModelConfig

BASE: dict[str, Any] = {"vocab_size": 10, "hidden_size": 64, "intermediate_size": 16,
                        "num_hidden_layers": 6, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 16}


def config(architecture: str, **fields: Any) -> ModelConfig:
    return ModelConfig.from_hf({**BASE, "architectures": [architecture], **fields})


def test_gemma3_as_transformers_4_wrote_it() -> None:
    # gemma-3-1b's keys: the global RoPE in rope_theta (+ rope_scaling), the local base and
    # the every-sixth-layer-is-global pattern as numbers, no layer_types.
    cfg = config("Gemma3ForCausalLM", rope_theta=1e6, rope_local_base_freq=1e4,
                 rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=512,
                 sliding_window_pattern=6, query_pre_attn_scalar=256,
                 hidden_activation="gelu_pytorch_tanh")
    assert [cfg.window(i) for i in range(6)] == [512] * 5 + [None]
    assert cfg.rope_of(0) == (1e4, None)
    assert cfg.rope_of(5) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert cfg.attention_scale == 256 ** -0.5 and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.tie_word_embeddings and cfg.scale_embeddings and cfg.qk_norm
    assert cfg.max_model_len == 131072  # the window no longer caps the context


def test_gemma3_as_transformers_5_writes_it() -> None:
    cfg = config("Gemma3ForCausalLM", sliding_window=8,
                 layer_types=["full_attention", "sliding_attention"] * 3,
                 rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": 100.0}})
    assert [cfg.window(i) for i in range(2)] == [None, 8]
    assert cfg.rope_of(0) == (5e5, None) and cfg.rope_of(1) == (100.0, None)


def test_phi3_su_scaling_is_longrope_with_the_top_level_original_length() -> None:
    factors = [1.0] * 8
    cfg = config("Phi3ForCausalLM", max_position_embeddings=131072,
                 original_max_position_embeddings=4096,
                 rope_scaling={"type": "su", "short_factor": factors, "long_factor": factors})
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
    assert cfg.rope_scaling["factor"] == 32  # max / original, as transformers derives it
    with pytest.raises(ConfigError, match=r"rope_scaling\.long_factor must list head_dim / 2"):
        config("Phi3ForCausalLM", rope_scaling={"type": "su", "short_factor": factors,
                                                "long_factor": [1.0]})


def test_qwen25_yarn_serves_the_extended_context() -> None:
    cfg = config("Qwen2ForCausalLM", max_position_embeddings=32768,
                 rope_scaling={"type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 32768})
    assert cfg.max_model_len == 131072  # as vLLM reads it
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 32768}


def test_which_layers_slide_per_family() -> None:
    qwen = {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 4}
    assert [config("Qwen3ForCausalLM", **qwen).window(i) for i in (3, 4)] == [None, 64]
    assert config("Qwen3ForCausalLM", **{**qwen, "use_sliding_window": False}).window(5) is None
    assert config("MistralForCausalLM", sliding_window=64).window(0) == 64
    assert config("MistralForCausalLM", sliding_window=None).window(0) is None
    assert config("LlamaForCausalLM", sliding_window=64).window(0) is None  # as transformers
    smol = config("SmolLM3ForCausalLM", no_rope_layer_interval=3, use_sliding_window=True,
                  sliding_window=32)
    assert smol.rope_layers == [True, True, False] * 2
    assert [smol.window(i) for i in range(3)] == [None, None, 32]  # the NoPE layers slide


def test_granite_multipliers() -> None:
    cfg = config("GraniteForCausalLM", embedding_multiplier=12.0, residual_multiplier=0.22,
                 attention_multiplier=0.0078125, logits_scaling=8.0)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_scale,
            cfg.logits_scaling) == (12.0, 0.22, 0.0078125, 8.0)


@pytest.mark.parametrize(("architecture", "fields", "message"), [
    ("Gemma3ForCausalLM", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("Gemma3ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("Gemma3ForCausalLM", {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ("Phi3ForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                             "partial_rotary_factor": 0.75}},
     "partial_rotary_factor 0.75"),
    ("Qwen3ForCausalLM", {"layer_types": ["chunked_attention"] * 6}, "chunked_attention"),
    ("Qwen3ForCausalLM", {"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
    ("SmolLM3ForCausalLM", {"no_rope_layers": [1, 0]}, "no_rope_layers has 2 entries"),
    ("Qwen2ForCausalLM", {"rope_scaling": {"type": "yarn"}}, r"rope_scaling\.factor"),
    ("GraniteForCausalLM", {"mlp_bias": True}, "mlp_bias"),
    ("Gemma3ForConditionalGeneration", {}, "architecture 'Gemma3ForConditionalGeneration'"),
])
def test_what_is_not_built_is_refused_by_name(architecture: str, fields: dict[str, Any],
                                              message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config(architecture, **fields)
