"""Tiny Hugging Face checkpoints and tokenizers built on the spot (no hub downloads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

VOCAB = 300
ROPE_VARIANTS: dict[str, dict[str, object] | None] = {
    "none": None,
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "factor": 2.0},
}
CORPUS = ["hello world, the quick brown fox jumps over the lazy dog",
          "ünïcødé text, 日本語のテキスト, emoji 🙂🚀 and more", "def f(x): return x * 2"]
CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


def build_hf_tokenizer() -> Tokenizer:
    """A byte-level BPE with VOCAB ids; multi-byte characters span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")


def build_gemma_tokenizer() -> Tokenizer:
    """Gemma's kind of tokenizer (no package ships one): SentencePiece-style BPE over "▁" for
    spaces, no prefix space, the 256 byte pieces <0x00>..<0xFF> as fallback for what the
    vocabulary lacks, Gemma's special tokens at its ids 0-3 and its turn markers."""
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Replace(" ", "▁")
    # Gemma's 262k pieces spell common punctuation whole; byte pieces stay for the rest.
    corpus = [*CORPUS, "Tokyo 東京 — naïve, em dashes — and 🙂"] * 10
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=VOCAB,
                                                            show_progress=False))
    learnt = json.loads(trained.to_str())["model"]
    pieces = [*GEMMA_SPECIALS, *(f"<0x{b:02X}>" for b in range(256))]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    for piece in sorted(learnt["vocab"], key=learnt["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learnt["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>",
                               fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in GEMMA_SPECIALS])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return tok


def write_tokenizer(path: Path, chat_template: str | None = CHAT_TEMPLATE) -> None:
    build_hf_tokenizer().save(str(path / "tokenizer.json"))
    cfg: dict[str, object] = {"bos_token": "<s>",
                              "eos_token": {"content": "</s>", "special": True}}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


def save_llama(path: Path, rope: str = "none", tie: bool = False,
               max_shard_size: str | None = None) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    # transformers 5 turns rope_scaling into rope_parameters; 4.x takes it as is.
    rope_kwargs: dict[str, Any] = {"rope_scaling": ROPE_VARIANTS[rope]}
    config = LlamaConfig(
        **rope_kwargs,
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=tie, bos_token_id=0,
        eos_token_id=1,
        # Larger than HF's 0.02 so attention is peaked: masking bugs then move the logits.
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    write_tokenizer(path)
    return model


WINDOW = 16  # sliding-window layers' window: the tests' prompts and generations run past it
LONGROPE_AFTER = 96  # Phi-3's original_max_position_embeddings
# A tiny config of each family as transformers' config class takes it: every feature the
# family differs from Llama by is on (2 layers, hidden 64, 4 heads of 16, 2 KV heads).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3", {"use_sliding_window": True, "sliding_window": WINDOW,
                        "max_window_layers": 1, "attention_bias": True}),
    "gemma3": ("Gemma3", {"sliding_window": WINDOW, "sliding_window_pattern": 2,
                              "query_pre_attn_scalar": 24, "rope_local_base_freq": 500.0,
                              "rope_theta": 10000.0, "final_logit_softcapping": 3.0,
                              "tie_word_embeddings": True}),
    # Prompts and generations stay under original_max_position_embeddings, which transformers'
    # generate handles by recomputing the whole sequence once crossed (test_families.py).
    "phi3": ("Phi3", {"sliding_window": WINDOW, "max_position_embeddings": 512,
                      "original_max_position_embeddings": LONGROPE_AFTER,
                      "rope_scaling": {"rope_type": "longrope",
                                       "short_factor": [1.0 + i / 8 for i in range(8)],
                                       "long_factor": [2.0 + i for i in range(8)]}}),
    "smollm3": ("SmolLM3", {"no_rope_layer_interval": 2, "use_sliding_window": True,
                            "sliding_window": WINDOW, "tie_word_embeddings": False}),
    "granite": ("Granite", {"embedding_multiplier": 4.0, "residual_multiplier": 0.5,
                            "attention_multiplier": 0.3, "logits_scaling": 2.5,
                            "attention_bias": True}),
    "mistral": ("Mistral", {"sliding_window": WINDOW}),
    "qwen2-yarn": ("Qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 64},
                             "max_position_embeddings": 64}),
}


def save_family(path: Path, family: str, tie: bool | None = None) -> torch.nn.Module:
    """A random checkpoint of `family` (FAMILIES) with the test tokenizer; the model back."""
    prefix, extra = FAMILIES[family]
    model = random_model(prefix, {**extra, **({} if tie is None else
                                              {"tie_word_embeddings": tie})})
    model.save_pretrained(path)
    write_tokenizer(path)
    return model


def random_model(prefix: str, extra: dict[str, Any]) -> torch.nn.Module:
    """A tiny random transformers model of the family named `prefix` ("Qwen3", "Gemma3"...):
    2 layers, hidden 64, 4 heads of 16, 2 KV heads, unless `extra` says otherwise."""
    import transformers

    config_class = getattr(transformers, "Gemma3TextConfig" if prefix == "Gemma3"
                           else f"{prefix}Config")
    model_class = getattr(transformers, f"{prefix}ForCausalLM")
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 512, "bos_token_id": 0, "eos_token_id": 1,
        "pad_token_id": 1, "initializer_range": 0.2, **extra}
    torch.manual_seed(0)
    model = model_class(config_class(**kwargs)).eval()
    with torch.no_grad():  # non-trivial norms and biases: a misplaced one moves the logits
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                param.normal_(0.0, 0.3).add_(0 if name.endswith("bias") else 0.5)
    return model
