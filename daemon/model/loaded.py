"""What loading a model gives, and what both its readers (loader.py: Hugging Face checkpoints and
the builtins; gguf_load.py: GGUF files) share: the error naming what cannot be loaded, the
tensor-parallel check, the model's sampling defaults, and the Hugging Face names of each of
tether's parameters (a GGUF file's tensors are mapped to them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

from daemon.model.config import ConfigError, ModelConfig
from daemon.model.decoder import DecoderLM
from daemon.model.parallel.group import TPGroup
from daemon.model.parallel.layers import check_shardable
from daemon.model.tokenizer import Tokenizer


class ModelLoadError(Exception):
    """The model spec cannot be loaded; the message names the file or the field."""


@dataclasses.dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    model: DecoderLM
    tokenizer: Tokenizer
    name: str  # the model id reported to clients
    max_model_len: int
    kernels: str = "torch"  # what the forward pass runs on: 'cpu', 'triton' or 'torch'
    # The model's own sampling defaults (generation_config.json, GGUF's general.sampling.*),
    # by SamplingParams field: what a request that omits the field gets (the daemon checks
    # them against what a request may ask for: ipc.records.GenerationDefaults).
    generation_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)


def check_shardable_at(where: object, config: ModelConfig, group: TPGroup) -> None:
    try:
        check_shardable(config, group.size)
    except ConfigError as e:
        raise ModelLoadError(f"{where}: {e}") from e


GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults a model states, by SamplingParams field (others ignored)."""
    return {k: v for k, v in values.items() if k in GENERATION_FIELDS and v is not None}


def hf_sources(config: ModelConfig, files: Collection[str] = ()) -> dict[str, list[str]]:
    """Our parameter name -> the HF tensors concatenated (dim 0) into it: one name where the
    checkpoint's tensor names (`files`) hold them fused (Phi-3's qkv_proj and gate_up_proj)."""
    out = {"embed_tokens.weight": ["model.embed_tokens.weight"],
           "norm.weight": ["model.norm.weight"]}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = ["lm_head.weight"]

    def fused(name: str, parts: list[str], suffix: str) -> list[str]:
        return [name + suffix] if name + suffix in files else [p + suffix for p in parts]

    # Our norms by role -> HF's. Gemma 3's post_attention_layernorm norms the attention's
    # output; its pre_feedforward_layernorm is the one before the MLP.
    norms = {"input_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm"}
    if config.sandwich_norms:
        norms = {"input_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                 "post_attention_norm": "pre_feedforward_layernorm",
                 "mlp_out_norm": "post_feedforward_layernorm"}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = hf + "self_attn."
        qkv = [f"{attn}{p}_proj" for p in "qkv"]
        out[ours + "attn.qkv_proj.weight"] = fused(attn + "qkv_proj", qkv, ".weight")
        if config.qkv_bias:
            out[ours + "attn.qkv_proj.bias"] = fused(attn + "qkv_proj", qkv, ".bias")
        out[ours + "attn.o_proj.weight"] = [attn + "o_proj.weight"]
        if config.o_bias:
            out[ours + "attn.o_proj.bias"] = [attn + "o_proj.bias"]
        if config.qk_norm:
            out[ours + "attn.q_norm.weight"] = [attn + "q_norm.weight"]
            out[ours + "attn.k_norm.weight"] = [attn + "k_norm.weight"]
        gate_up = [hf + "mlp.gate_proj", hf + "mlp.up_proj"]
        out[ours + "mlp.gate_up_proj.weight"] = fused(hf + "mlp.gate_up_proj", gate_up, ".weight")
        out[ours + "mlp.down_proj.weight"] = [hf + "mlp.down_proj.weight"]
        for mine, theirs in norms.items():
            out[f"{ours}{mine}.weight"] = [f"{hf}{theirs}.weight"]
    return out
