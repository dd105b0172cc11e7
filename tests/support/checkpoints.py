"""Tiny Hugging Face checkpoints and tokenizers built on the spot (no hub downloads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

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
