"""Real tokenizers, obtained offline from a package registry and never committed.

llama.cpp's source distribution on PyPI (the llama-cpp-python sdist) carries vocab-only GGUF files
of real model families and the chat templates of real checkpoints. transformers' GGUF loader (it
needs the `gguf` package) turns a GGUF vocab into a tokenizer.json + tokenizer_config.json. The
sdist is fetched with pip once into the user cache and the converted tokenizers are kept there,
keyed by the sdist and transformers versions, so later runs neither download nor convert.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from daemon.model.config import MODEL_TYPES

SDIST = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
_MODELS = "vendor/llama.cpp/models/"
_FORMAT = 3  # bumped when _convert changes what it writes


@dataclass(frozen=True)
class Family:
    gguf: str | None  # under vendor/llama.cpp/models/; None: Gemma's kind, trained here
    template: str | None  # under models/templates/; None: the GGUF's own, if any
    architecture: str  # of the random checkpoint made with this vocabulary
    eos: tuple[str, ...]  # the tokens that end a turn in the family's instruct models
    added: tuple[str, ...] = ()  # special tokens the family adds to the GGUF's vocabulary
    # Of the random weights: one whose greedy answers in tests/e2e/test_real_checkpoints.py are
    # whole UTF-8 (a random model's bytes need not be; those tests join them into text).
    seed: int = 0


FAMILIES = {
    # Llama 3: byte-level BPE, 128k ids, 256 added special tokens.
    "llama3": Family("ggml-vocab-llama-bpe.gguf", "meta-llama-Llama-3.1-8B-Instruct.jinja",
                     "LlamaForCausalLM", ("<|eot_id|>", "<|end_of_text|>")),
    # Llama 2 / Mistral 7B: SentencePiece BPE with byte fallback pieces <0x00>..<0xFF>; the
    # Mistral template raises for roles that do not alternate.
    "spm": Family("ggml-vocab-llama-spm.gguf", "mistralai-Mistral-Nemo-Instruct-2407.jinja",
                  "MistralForCausalLM", ("</s>",)),
    # Qwen2: byte-level BPE, 151k ids, ChatML template shipped in the GGUF.
    "qwen2": Family("ggml-vocab-qwen2.gguf", None, "Qwen2ForCausalLM",
                    ("<|im_end|>", "<|endoftext|>")),
    # GPT-2: byte-level BPE, no chat template at all.
    "gpt2": Family("ggml-vocab-gpt-2.gguf", None, "LlamaForCausalLM", ("<|endoftext|>",)),
    # Qwen3: Qwen2's vocabulary, its own template (thinking tags).
    "qwen3": Family("ggml-vocab-qwen2.gguf", "Qwen-Qwen3-0.6B.jinja", "Qwen3ForCausalLM",
                    ("<|im_end|>", "<|endoftext|>"), seed=2),
    # Phi-3: SentencePiece with byte fallback, 32k ids and <|user|>/<|end|> turn tokens.
    "phi3": Family("ggml-vocab-phi-3.gguf", "microsoft-Phi-3.5-mini-instruct.jinja",
                   "Phi3ForCausalLM", ("<|end|>", "<|endoftext|>"), seed=1),
    # SmolLM3: Llama 3's vocabulary, whose reserved tokens the checkpoint renames to its ChatML
    # turn tokens; here those are added as special tokens instead.
    "smollm3": Family("ggml-vocab-llama-bpe.gguf", "HuggingFaceTB-SmolLM3-3B.jinja",
                      "SmolLM3ForCausalLM", ("<|im_end|>", "<|end_of_text|>"),
                      ("<|im_start|>", "<|im_end|>")),
    # Granite 3: StarCoder's byte-level BPE with Granite's role and end tokens added (49,155
    # ids, as Granite's).
    "granite": Family("ggml-vocab-starcoder.gguf", "ibm-granite-granite-3.3-2B-Instruct.jinja",
                      "GraniteForCausalLM", ("<|end_of_text|>",),
                      ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>")),
    # Gemma: no package ships a Gemma 3 tokenizer or template, so its kind of tokenizer is
    # trained (tests/support/checkpoints.py) and Gemma 2's template, the same turn format
    # (it refuses a system turn, which Gemma 3's folds into the first user turn), renders.
    "gemma": Family(None, "google-gemma-2-2b-it.jinja", "Gemma3ForCausalLM",
                    ("<eos>", "<end_of_turn>")),
}


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tether-tests"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    # Several worktrees' test runs may share the cache: one fetches, the others wait for it.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _sdist() -> Path:
    """The cached sdist; skips the test when the registry cannot be reached."""
    dest = cache_root() / "downloads"
    found = sorted(dest.glob(f"llama_cpp_python-{SDIST_VERSION}.tar.gz"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), f"{SDIST}=={SDIST_VERSION}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    found = sorted(dest.glob(f"llama_cpp_python-{SDIST_VERSION}.tar.gz"))
    if proc.returncode != 0 or not found:
        pytest.skip(f"real tokenizers need {SDIST}=={SDIST_VERSION} from the package registry, "
                    f"and pip download failed: {(proc.stderr or proc.stdout)[-800:]}")
    return found[0]


def _extract(sdist: Path, names: list[str], into: Path) -> None:
    with tarfile.open(sdist) as tar:
        root = tar.getnames()[0].split("/")[0]
        for name in names:
            member = tar.getmember(f"{root}/{_MODELS}{name}")
            source = tar.extractfile(member)
            assert source is not None, member.name
            (into / Path(name).name).write_bytes(source.read())


def _convert(family: Family, sdist: Path, out: Path) -> None:
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as raw_dir:
        raw = Path(raw_dir)
        names = ([family.gguf] if family.gguf else []) + (
            [f"templates/{family.template}"] if family.template else [])
        _extract(sdist, names, raw)
        if family.gguf is None:
            _write_gemma(raw)
        tok = (AutoTokenizer.from_pretrained(raw, gguf_file=family.gguf) if family.gguf
               else AutoTokenizer.from_pretrained(raw))
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in family.added],
                       special_tokens=True)
        tok.save_pretrained(out)
        # The pipeline transformers runs once the files are reloaded, as a checkpoint ships it:
        # the GGUF's lacks what a tokenizer class adds (Qwen2's NFC normalizer).
        AutoTokenizer.from_pretrained(out).backend_tokenizer.save(str(out / "tokenizer.json"))
        if family.template:
            (out / "chat_template.jinja").write_text((raw / family.template).read_text())


def _write_gemma(into: Path) -> None:
    from tests.support.checkpoints import build_gemma_tokenizer

    build_gemma_tokenizer().save(str(into / "tokenizer.json"))
    names = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
             "unk_token": "<unk>"}
    (into / "tokenizer_config.json").write_text(json.dumps(names))


@functools.cache
def tokenizer_dir(name: str) -> Path:
    """A directory with the family's tokenizer.json, tokenizer_config.json and chat template."""
    import transformers

    family = FAMILIES[name]
    key = f"{SDIST}-{SDIST_VERSION}-transformers-{transformers.__version__}-{_FORMAT}"
    out = cache_root() / "tokenizers" / key / name
    with _locked(cache_root() / "lock"):
        if not (out / "tokenizer.json").is_file():
            sdist = _sdist()
            staging = Path(tempfile.mkdtemp(dir=cache_root()))
            try:
                _convert(family, sdist, staging)
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(out, ignore_errors=True)
                staging.rename(out)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return out


def _unpacked(kind: str, under: str, suffixes: tuple[str, ...]) -> Path:
    """The sdist's files under vendor/llama.cpp/models/`under` ending in one of `suffixes`,
    unpacked once into the cache (folder `kind`)."""
    out = cache_root() / kind / f"{SDIST}-{SDIST_VERSION}"
    with _locked(cache_root() / "lock"):
        if not out.is_dir():
            sdist = _sdist()
            staging = Path(tempfile.mkdtemp(dir=cache_root()))
            with tarfile.open(sdist) as tar:
                prefix = f"{tar.getnames()[0].split('/')[0]}/{_MODELS}{under}"
                for member in tar.getmembers():
                    rest = member.name.removeprefix(prefix)
                    if (member.name.startswith(prefix) and "/" not in rest
                            and rest.endswith(suffixes)):
                        source = tar.extractfile(member)
                        assert source is not None
                        (staging / Path(member.name).name).write_bytes(source.read())
            out.parent.mkdir(parents=True, exist_ok=True)
            staging.rename(out)
    return out


def chat_templates() -> dict[str, str]:
    """Every chat template in llama.cpp's models/templates (name -> source), cached."""
    out = _unpacked("templates", "templates/", (".jinja",))
    return {p.stem: p.read_text() for p in sorted(out.glob("*.jinja"))}


def vocab_file(name: str) -> Path:
    """llama.cpp's ggml-vocab-`name`.gguf: a family's tokenizer metadata without weights. Beside
    it, where llama.cpp has them, its tokenizer test: `.inp`, texts, and `.out`, the ids the
    family's own Hugging Face tokenizer gives them (convert_hf_to_gguf_update.py wrote both)."""
    out = _unpacked("vocab", "ggml-vocab-", (".gguf", ".inp", ".out"))
    return out / f"ggml-vocab-{name}.gguf"


def vocab_test(path: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's tokenizer test for a vocab file: (text, ids without BOS) pairs."""
    texts = path.with_suffix(".gguf.inp").read_text(encoding="utf-8").split(
        "\n__ggml_vocab_test__\n")
    ids = path.with_suffix(".gguf.out").read_text().split("\n")
    # Each file ends in the separator and an empty text, whose ids line is the last, empty one.
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, ids,
                                                                         strict=True)]


def save_random_checkpoint(name: str, path: Path, seed: int | None = None,
                           max_len: int = 1024, end_scale: float = 1.0) -> Path:
    """A tiny random model of the family's architecture with the real tokenizer's vocabulary;
    `max_len` its context. `end_scale` scales the embedding of the token that ends a turn (the
    embeddings are tied, so its logit too): a random model of a large vocabulary all but never
    samples it, and one scaled by a few ends its turns within tens of tokens, as a client
    that runs turns until the model answers needs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    family = FAMILIES[name]
    tok_dir = tokenizer_dir(name)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    eos = [tok.convert_tokens_to_ids(t) for t in family.eos]
    config: Any = AutoConfig.for_model(
        MODEL_TYPES[family.architecture], architectures=[family.architecture],
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=max_len, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=eos, initializer_range=0.5)
    torch.manual_seed(family.seed if seed is None else seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_input_embeddings().weight[eos[0]] *= end_scale
    model.save_pretrained(path)
    for file in tok_dir.iterdir():
        shutil.copy(file, path / file.name)
    return path


def reference(name: str) -> Any:
    """transformers' own tokenizer for the family: what tether must agree with."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir(name))
