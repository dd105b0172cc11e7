"""A random Llama checkpoint of a given shape for the decode benchmarks, written with
save_pretrained, and the byte-level tokenizer it ships with (one token per byte)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SMOLLM_135M: dict[str, Any] = {
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 0,
    "eos_token_id": 0, "pad_token_id": 0}
SMOLLM_135M_DIR = Path("/tmp/tether-bench-smollm135m")  # shared by the benchmarks that serve it


def ensure_checkpoint(path: Path = SMOLLM_135M_DIR) -> Path:
    """The SmolLM-135M-shaped checkpoint at `path`, written first when it is not there."""
    if not (path / "config.json").is_file():
        print(f"writing a random SmolLM-135M-shaped checkpoint to {path}", flush=True)
        write_checkpoint(path)
    return path


def write_checkpoint(path: Path, config: dict[str, Any] = SMOLLM_135M) -> None:
    """A random Llama of `config`'s shape (SmolLM-135M's by default) + a byte-level
    tokenizer (one token per byte)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).float()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path)


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer without merges: id 0 is <|endoftext|>, ids 1..256 the bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, **{ch: i + 1 for i, ch in enumerate(sorted(alphabet))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def ensure_gguf_folder(gguf: Path, path: Path) -> Path:
    """A Hugging Face folder at `path` of the GGUF file's weights dequantized to float32, with
    its tokenizer, written first when it is not there: what vLLM serves, which reads no GGUF
    file of this kind, so that both servers hold the same numbers."""
    if not (path / "config.json").is_file():
        print(f"writing {gguf.name} dequantized to float32 as a Hugging Face folder at {path}",
              flush=True)
        write_gguf_folder(gguf, path)
    return path


def write_gguf_folder(gguf: Path, path: Path) -> None:
    """transformers' reading of the file (it dequantizes; needs gguf and accelerate) saved
    anew: a model built from its config without the `quantization_config` that says the
    weights came from a GGUF file (with it save_pretrained and vLLM want the file back)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    read = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                dtype=torch.float32)
    config = read.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(read.state_dict())
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(path)
