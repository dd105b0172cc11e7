"""A GGUF file's tokenizer (its `tokenizer.ggml.*` keys) built as a `tokenizers` tokenizer, the
way transformers builds it from the same keys, so that ids and text agree with it exactly:

- `gpt2`: byte-level BPE from the vocabulary and merges, text split as `tokenizer.ggml.pre`
  names (a name whose split is not known here is refused: a wrong split encodes silently wrong);
- `llama`: SentencePiece BPE with byte fallback, merges recovered from the scores (Gemma's from
  the vocabulary's order, Phi-3's prefix space from a normalizer).

Control tokens become special tokens (never text, never split), user-defined ones plain added
tokens; `tokenizer.ggml.add_bos_token` adds BOS, `tokenizer.chat_template` is the chat template.
"""

from __future__ import annotations

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
# tokenizer.ggml.pre -> how text is split before the merges (llama.cpp's table for these names).
# StarCoder's family (SmolLM, Granite) splits digits one by one, then as GPT-2 does.
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **{name: (_GPT2_SPLIT,) for name in ("gpt-2", "gpt2", "phi-2", "roberta-bpe")},
    **{name: (r"\p{N}", _GPT2_SPLIT) for name in ("smollm", "starcoder", "refact", "codeshell")},
    **{name: (_LLAMA3_SPLIT,) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3",
                                           "pixtral", "dbrx", "smaug-bpe")},
    **{name: (_QWEN2_SPLIT,) for name in ("qwen2", "deepseek-r1-qwen", "megrez")},
}


class GGUFTokenizerError(ValueError):
    """The file's tokenizer keys are missing or name a tokenizer not built here."""


def load_gguf_tokenizer(file: GGUFFile, extra_eos_ids: list[int]) -> HFTokenizer:
    tokens = _string_list(file, "tokenizer.ggml.tokens")
    kind = file.string("tokenizer.ggml.model")
    types = file.get("tokenizer.ggml.token_type") or []
    if kind == "gpt2":
        tok = _byte_level(file, tokens)
    elif kind == "llama":
        tok = _sentencepiece(file, tokens)
    else:
        raise GGUFTokenizerError(f"{file.path}: tokenizer.ggml.model {kind!r} is not supported "
                                 "(supported: gpt2, llama)")
    _add_tokens(tok, tokens, types, byte_level=kind == "gpt2")
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


def _byte_level(file: GGUFFile, tokens: list[str]) -> tokenizers.Tokenizer:
    pre = file.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise GGUFTokenizerError(f"{file.path}: tokenizer.ggml.pre {pre!r} is not supported "
                                 f"(supported: {', '.join(PRE_TOKENIZERS)})")
    spelling = {b: c for c, b in byte_level_alphabet().items()}
    alphabet = set(spelling.values())
    # A token outside the byte alphabet (a mislabelled control token) is spelled in it, as
    # transformers spells it.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
             for i, t in enumerate(tokens)}
    merges = [_pair(m) for m in _string_list(file, "tokenizer.ggml.merges")]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(
        vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
        end_of_word_suffix="", fuse_unk=False))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
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
    elif file.arch == "phi3":  # the prefix space from a normalizer, as Phi-3's tokenizer.json
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                               normalizers.Replace(" ", "\u2581")])
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                     prepend_scheme="first", split=False)
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


def _add_tokens(tok: tokenizers.Tokenizer, tokens: list[str], types: list[Any],
                byte_level: bool) -> None:
    """Control tokens as special tokens, user-defined ones as plain added tokens: both are
    matched whole in the text. A control token a byte-level vocabulary cannot spell is a
    mislabel of llama.cpp's converter and is left as it is."""
    alphabet = set(byte_level_alphabet()) if byte_level else None
    control = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, types, strict=False)
               if kind == CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types, strict=False) if kind == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)


def _post_processor(tok: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> None:
    marks = [t for t in (bos, eos) if t is not None]
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(t, tok.token_to_id(t)) for t in marks])
