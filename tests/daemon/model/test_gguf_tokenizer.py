"""The tokenizer tether builds from a GGUF file's metadata (daemon/model/gguf_tokenizer.py), on
llama.cpp's vocab files of real families (tests/support/real_tokenizers.py fetches them once):

- it gives the ids the family's own Hugging Face tokenizer gives on llama.cpp's tokenizer test
  (the .out beside each vocab file, which llama.cpp wrote with that tokenizer);
- it encodes, with BOS as the file says, and decodes exactly as transformers' own GGUF
  tokenizer on a corpus of Unicode, code, digits, whitespace runs and the file's special tokens.
  Where transformers' reader drops a setting of the family's tokenizer.json, the reference is
  transformers' tokenizer with that setting put back (CORRECTIONS), once shown that without it
  transformers departs from the family's own ids.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import normalizers, pre_tokenizers

from daemon.model.gguf_file import GGUFFile
from daemon.model.gguf_tokenizer import load_gguf_tokenizer
from daemon.model.loader import ModelLoadError, load_model
from daemon.model.tokenizer import HFTokenizer
from tests.support.checkpoints import save_llama
from tests.support.gguf_files import family_model, write_gguf
from tests.support.real_tokenizers import vocab_file, vocab_test

pytestmark = pytest.mark.timeout(600)

# llama.cpp's vocab files whose tokenizer.ggml.pre (or SentencePiece model) tether builds.
VOCABS = ["gpt-2", "llama-spm", "llama-bpe", "phi-3", "qwen2", "starcoder", "refact",
          "deepseek-coder", "deepseek-llm"]
CORPUS = [
    "Hello, world! The year 2024 had 366 days; 3.14159 is π, and ½ ² ³ are numbers too.",
    "日本語のテキストと中文文本\uff0c还有한국어 텍스트。",
    "emoji 🙂🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽 keycap 1️⃣",
    "combining: e\u0301 a\u0300\u0323 Tiếng Việt, देवनागरी, ภาษาไทย, Ελληνικά, Cửa Việt",
    "def reverse(s: str) -> str:\n    return s[::-1]  # slicing\n\n\tif x != y:\n\t\tpass\n",
    'JSON: {"key": [1, 2.5e-3, null, true], "n": 1234567890}',
    "  leading spaces, trailing spaces   \n\n\nnewlines\r\nand CRLF\t\t tabs",
    " one leading space",
    "I'm sure you'RE right; we'll see. HE'S 'ere",
]


def _prefix_space(ref: Any) -> None:
    # Llama 2's tokenizer.json: SentencePiece's prefix space on each stretch of text.
    ref.backend_tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    ref.backend_tokenizer.pre_tokenizer = None


def _ignore_merges(ref: Any) -> None:
    ref.backend_tokenizer.model.ignore_merges = True  # Llama 3's tokenizer.json


def _digits(ref: Any) -> None:
    # StarCoder 2's tokenizer.json: digits one by one, then GPT-2's split.
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


CORRECTIONS: dict[str, Callable[[Any], None]] = {
    "llama-spm": _prefix_space, "llama-bpe": _ignore_merges, "starcoder": _digits}
# transformers cannot read refact's architecture, splits DeepSeek's text as GPT-2's and puts
# its BOS past the vocabulary: these are checked against the family's own ids alone.
NOT_READ_ALIKE = ("refact", "deepseek-coder", "deepseek-llm")


@functools.cache
def opened(name: str) -> GGUFFile:
    return GGUFFile(vocab_file(name))


@functools.cache
def ours(name: str) -> HFTokenizer:
    return load_gguf_tokenizer(opened(name), [])


def reference(name: str) -> Any:
    from transformers import AutoTokenizer

    path = vocab_file(name)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("name", VOCABS)
def test_ids_are_the_familys_own(name: str) -> None:
    tok = ours(name)
    for text, ids in vocab_test(vocab_file(name)):
        assert tok.encode(text, add_special_tokens=False) == ids, text


def special_texts(name: str) -> list[str]:
    """Text around the file's control tokens (its BOS and EOS first), which stay whole."""
    file = opened(name)
    tokens, types = file.require("tokenizer.ggml.tokens"), file.require("tokenizer.ggml.token_type")
    named = [tokens[file.integer(f"tokenizer.ggml.{k}_token_id")] for k in ("bos", "eos")]
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == 3 and t not in named]
    a, b, *_ = [*named, *control[:2]]
    return [f"{a}Hi there{b}", f"{b} after a special{a}\n{a}", f"x{b}{b} 12{a}  y"]


@pytest.mark.parametrize("name", [n for n in VOCABS if n not in NOT_READ_ALIKE])
def test_encodes_and_decodes_as_transformers_gguf_tokenizer(name: str) -> None:
    tok, ref, file = ours(name), reference(name), opened(name)
    if name in CORRECTIONS:
        # The correction is needed: without it transformers gives ids the family's own tokenizer
        # does not (when transformers mends its reader, drop the correction).
        assert any(ref.encode(text, add_special_tokens=False) != ids
                   for text, ids in vocab_test(file.path))
        CORRECTIONS[name](ref)
    add_bos = file.get("tokenizer.ggml.add_bos_token")
    add_bos = file.string("tokenizer.ggml.model") == "llama" if add_bos is None else add_bos
    bos = [tok.bos_token_id] if add_bos else []
    for text in [*CORPUS, *special_texts(name)]:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert ids == bos + tok.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    for text, ids in vocab_test(file.path):
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text


def test_a_gemma_file_tokenizes_as_transformers_reads_it(tmp_path: Path) -> None:
    """Gemma's SentencePiece kind (no vocab file of it ships with llama.cpp): merges in the
    vocabulary's order, not the scores', runs of spaces stored as spaces, no prefix space."""
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "gemma.gguf", family_model("gemma3"))
    tok = load_gguf_tokenizer(GGUFFile(path), [])
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = [*CORPUS, "<start_of_turn>user\nHi  there   you<end_of_turn>\n<eos>", "a  b   c"]
    for text in texts:
        ids = tok.encode(text)
        assert ids == ref.encode(text) and ids[0] == tok.bos_token_id, text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert tok.encode("a  b", add_special_tokens=False)[1] == len(GGUFFile(path).require(
        "tokenizer.ggml.tokens")) - 2  # the run of two spaces, whole


def test_deepseek_special_tokens_keep_their_ids() -> None:
    """DeepSeek's added tokens are spelled outside the byte alphabet (fullwidth bars, U+2581):
    they keep their ids in the vocabulary and stay whole in the text."""
    tok, file = ours("deepseek-coder"), opened("deepseek-coder")
    tokens = file.require("tokenizer.ggml.tokens")
    bos = file.integer("tokenizer.ggml.bos_token_id")
    assert tokens[bos] == "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
    assert tok.bos_token_id == bos < len(tokens) == tok.vocab_size
    text = "def f():<\uff5cfim\u2581hole\uff5c>return 1"
    ids = tok.encode(text)
    assert ids[0] == bos and tokens.index("<\uff5cfim\u2581hole\uff5c>") in ids
    assert tok.decode(ids) == text


def test_a_pre_tokenizer_not_known_or_missing_is_refused_at_start(tmp_path: Path) -> None:
    model = save_llama(tmp_path / "hf")
    for pre, said in (("tekken", "'tekken' is not supported"), (None, "is missing")):
        def edit(w: Any, pre: str | None = pre) -> None:
            w.kv_data[0].pop("tokenizer.ggml.pre")
            if pre is not None:
                w.add_tokenizer_pre(pre)

        path = write_gguf(tmp_path / f"{pre}.gguf", model, edit=edit)
        with pytest.raises(ModelLoadError, match=rf"{path}: tokenizer\.ggml\.pre {said}"):
            load_model(str(path), "cpu", "float32")
