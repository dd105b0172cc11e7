"""Tiny Hugging Face checkpoints built on the spot (no hub downloads)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

torch.set_num_threads(2)

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


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory
                     ) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """make(rope="none"|"llama3"|"linear", tie=False) -> (directory, transformers model)."""
    cache: dict[tuple[str, bool], tuple[Path, torch.nn.Module]] = {}

    def make(rope: str = "none", tie: bool = False) -> tuple[Path, torch.nn.Module]:
        if (rope, tie) not in cache:
            path = tmp_path_factory.mktemp(f"llama-{rope}-{'tied' if tie else 'untied'}")
            cache[rope, tie] = (path, save_llama(path, rope, tie))
        return cache[rope, tie]

    return make


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf-tokenizer")
    write_tokenizer(path)
    return path


def random_cache(lens: list[int], kv_heads: int, head_dim: int, block: int = 16,
                 dtype: torch.dtype = torch.float32, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cache [2, blocks, KVH, block, d], block tables [D, max_blocks], lens [D]); each
    sequence's blocks scattered over the pool, tables padded with block 0."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block) for n in lens]
    num_blocks = sum(per_seq) + 3
    cache = torch.randn(2, num_blocks, kv_heads, block, head_dim, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(per_seq)
    tables = [[ids.pop() for _ in range(n)] + [0] * (width - n) for n in per_seq]
    return cache, torch.tensor(tables), torch.tensor(lens)
