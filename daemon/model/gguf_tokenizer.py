"""A GGUF file's tokenizer (its `tokenizer.ggml.*` keys) built as a `tokenizers` tokenizer that
gives the ids the family's own tokenizer gives, as llama.cpp does (its vocab files' tests hold
those ids: tests/daemon/model/test_gguf_tokenizer.py), and as transformers' GGUF reader does
wherever that one keeps what the family's tokenizer.json says:

- `gpt2`: byte-level BPE from the vocabulary and merges, text split as `tokenizer.ggml.pre`
  names (a name whose split is not known here is refused: a wrong split encodes silently wrong);
- `llama`: SentencePiece BPE with byte fallback, merges recovered from the scores (Gemma's from
  the vocabulary's order), SentencePiece's prefix space before each stretch of text (Gemma:
  none).

Control tokens become special tokens (never text, never split), user-defined ones plain added
tokens; `tokenizer.ggml.add_bos_token` adds BOS, `tokenizer.chat_template` is the chat template.
Where transformers' reader departs from the family's tokenizer, this follows the family's: it
drops Llama 3's ignore_merges, StarCoder's digit split and DeepSeek's splits, and gives Llama 2
no prefix space on text that starts with a space or follows a special token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors

from daemon.model.tokenizer import HFTokenizer, byte_level_alphabet

if TYPE_CHECKING:
    from daemon.model.gguf_file import GGUFFile

CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (llama.cpp's llama_token_type)

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# DeepSeek LLM's letters: the cased ones (its tokenizer.json's class, as llama.cpp copied it).
_DEEPSEEK_LETTERS = ("A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
                     "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a"
                     "\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556"
                     "\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
                     "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
                     "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
                     "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
                     "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
                     "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
                     "\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
                     "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
                     "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
                     "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
                     "\U000118a0-\U000118df\U0001e900-\U0001e943")
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # DeepSeek's: CJK ideographs, Hangul


@dataclass(frozen=True)
class PreTokenizer:
    """How a `tokenizer.ggml.pre` splits text before the merges: each regex in turn isolates
    its matches (llama.cpp's regex_exprs, which its converter copied from the family's
    tokenizer.json); `ignore_merges`: a piece the vocabulary holds whole is one token even where
    the merges would not build it (Llama 3's tokenizer.json says so, and llama.cpp does it)."""

    splits: tuple[str, ...]
    ignore_merges: bool = False


# tokenizer.ggml.pre -> its split, for the names llama.cpp gives these splits. StarCoder's family
# (SmolLM, Granite) splits digits one by one, then as GPT-2 does.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "roberta-bpe"), PreTokenizer((_GPT2_SPLIT,))),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell"),
                    PreTokenizer((r"\p{N}", _GPT2_SPLIT))),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"),
                    PreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True)),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3_SPLIT,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), PreTokenizer((_QWEN2_SPLIT,))),
    "deepseek-coder": PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    "deepseek-llm": PreTokenizer((r"[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+",
                                  "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                                  r"\s+$", _CJK, r"\p{N}+")),
}


class GGUFTokenizerError(ValueError):
    """The file's tokenizer keys are missing or name a tokenizer not built here."""


def load_gguf_tokenizer(file: GGUFFile, extra_eos_ids: list[int]) -> HFTokenizer:
    tokens = _string_list(file, "tokenizer.ggml.tokens")
    kind = file.string("tokenizer.ggml.model")
    types = file.get("tokenizer.ggml.token_type") or []
    if kind == "gpt2":
        tok = _byte_level(file, tokens, types)
    elif kind == "llama":
        tok = _sentencepiece(file, tokens)
    else:
        raise GGUFTokenizerError(f"{file.path}: tokenizer.ggml.model {kind!r} is not supported "
                                 "(supported: gpt2, llama)")
    _add_tokens(tok, tokens, types)
    named = {name: _token(file, tokens, key) for name, key in (
        ("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
    add_bos = file.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:  # old SentencePiece files say nothing, and llama.cpp adds BOS to them
        add_bos = kind == "llama"
    _post_processor(tok, named["bos_token"] if add_bos else None,
                    named["eos_token"] if file.get("tokenizer.ggml.add_eos_token") else None)
    template = file.get("tokenizer.chat_template")
    return HFTokenizer(tok, template if isinstance(template, str) else None,
                       extra_eos_ids=extra_eos_ids, **named)


def _string_list(file: GGUFFile, key: str) -> list[str]:
    values = file.require(key)
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise GGUFTokenizerError(f"{file.path}: metadata key {key!r} must be a list of strings")
    return values


def _token(file: GGUFFile, tokens: list[str], key: str) -> str | None:
    token_id = file.get(f"tokenizer.ggml.{key}")
    if token_id is None:
        return None
    if not isinstance(token_id, int) or not 0 <= token_id < len(tokens):
        raise GGUFTokenizerError(f"{file.path}: tokenizer.ggml.{key} {token_id!r} is not an id "
                                 f"of the vocabulary's {len(tokens)} tokens")
    return tokens[token_id]


def _byte_level(file: GGUFFile, tokens: list[str], types: list[Any]) -> tokenizers.Tokenizer:
    pre = file.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        # A wrong split encodes silently wrong, so a name not known here is refused; so is none
        # (llama.cpp guesses GPT-2's and warns that quality suffers).
        said = "is missing" if pre is None else f"{pre!r} is not supported"
        raise GGUFTokenizerError(f"{file.path}: tokenizer.ggml.pre {said} "
                                 f"(supported: {', '.join(PRE_TOKENIZERS)})")
    spelling = {b: c for c, b in byte_level_alphabet().items()}
    alphabet = set(spelling.values())
    # The merges' tokens are spelled in the byte alphabet, added ones (control, user-defined) as
    # their text: DeepSeek's BOS (fullwidth bars and U+2581), GPT-NeoX's runs of spaces (transformers
    # respells those too, which moves DeepSeek's BOS past the vocabulary). A normal token
    # outside the alphabet is respelled in it.
    vocab = {t if set(t) <= alphabet or kind in (CONTROL, USER_DEFINED)
             else "".join(spelling[b] for b in t.encode()): i
             for i, (t, kind) in enumerate(zip(tokens, _padded(types, len(tokens)), strict=True))}
    merges = [_pair(m) for m in _string_list(file, "tokenizer.ggml.merges")]
    split = PRE_TOKENIZERS[pre]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(
        vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
        end_of_word_suffix="", fuse_unk=False, ignore_merges=split.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in split.splits]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _sentencepiece(file: GGUFFile, tokens: list[str]) -> tokenizers.Tokenizer:
    scores = file.require("tokenizer.ggml.scores")
    gemma = file.arch == "gemma3"
    if gemma:
        # Gemma stores a run of spaces as spaces, and its merge order is the vocabulary's order,
        # not its scores'.
        tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
        scores = [-i for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    unk = tokens[file.integer("tokenizer.ggml.unknown_token_id", 0)]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(
        vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None,
        unk_token=unk if gemma else None))
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        # SentencePiece's dummy prefix on every stretch of text, the first and each after an
        # added token, as llama.cpp adds it and Llama 2's and Phi-3's tokenizer.json do.
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                               normalizers.Replace(" ", "\u2581")])
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges_from_scores(vocab: dict[str, int],
                        scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece's BPE merges as its scores imply them: each piece made of two pieces, best
    score first (transformers' generate_merges)."""
    found: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        pairs = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        found.extend(sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]])))
    found.sort(key=lambda p: (p[2], len(p[0]), len(p[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_tokens(tok: tokenizers.Tokenizer, tokens: list[str], types: list[Any]) -> None:
    """Control tokens as special tokens, user-defined ones as plain added tokens: both are
    matched whole in the text, as llama.cpp matches them."""
    kinds = _padded(types, len(tokens))
    control = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, kinds, strict=True) if kind == CONTROL]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, kinds, strict=True) if kind == USER_DEFINED]
    if user:
        tok.add_tokens(user)


def _padded(types: list[Any], n: int) -> list[Any]:
    """tokenizer.ggml.token_type for each of the n tokens (normal where the list is short)."""
    return [*types[:n], *[1] * (n - len(types))]


def _post_processor(tok: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> None:
    marks = [t for t in (bos, eos) if t is not None]
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(t, tok.token_to_id(t)) for t in marks])
