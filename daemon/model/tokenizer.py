"""Tokenizers: a built-in byte tokenizer and Hugging Face tokenizer.json (their chat templates
are rendered by daemon/model/chat_template.py).

Both implement `Tokenizer`. `IncrementalDetokenizer` turns a stream of sampled ids into text
pieces without ever splitting a multi-byte character (works for any `Tokenizer`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import tokenizers

from daemon.model.chat_template import BYTE_CHAT_TEMPLATE, ChatTemplateError, render_chat_template

__all__ = ["ByteTokenizer", "ChatTemplateError", "HFTokenizer", "IncrementalDetokenizer",
           "Tokenizer", "TokenizerLoadError"]


class TokenizerLoadError(ValueError):
    """A tokenizer file is missing or unreadable; the message names the file."""


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_ids: list[int]
    vocab_size: int  # ids >= this never come out of encode and decode to nothing
    special_token_ids: list[int]  # control tokens (BOS, EOS, chat markers): never text
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens=False for text from apply_chat_template (it has its own BOS)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Special tokens are skipped; invalid UTF-8 becomes U+FFFD."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to the text, special tokens included (for logprobs): part
        of a UTF-8 character where the token holds only part of one."""
        ...

    def tail_is_open(self, ids: Sequence[int]) -> bool:
        """Whether the text of `ids` may still change as more ids follow, other than in one
        trailing unfinished character (see IncrementalDetokenizer)."""
        ...

    def show_in_text(self, tokens: Sequence[str]) -> None:
        """These special tokens decode as their text, where special tokens are skipped: the
        markers a tool-call format writes (Mistral's [TOOL_CALLS])."""
        ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """`tools` as transformers' apply_chat_template takes them: JSON-schema dicts."""
        ...

    @property
    def tokenizer_json(self) -> str | None:
        """The Hugging Face tokenizer.json this tokenizer runs, None for the built-in one (the
        grammar engine reads a vocabulary from it: daemon/engine/grammar.py)."""
        ...


# ---- built-in byte tokenizer

BYTE_SPECIALS = ("<bos>", "<eos>", "<|im_start|>", "<|im_end|>")
class ByteTokenizer:
    """Ids 0..255 are bytes, then <bos>, <eos>, <|im_start|>, <|im_end|> (ChatML-style chat)."""

    tokenizer_json: str | None = None

    def __init__(self) -> None:
        self.special_ids = {name: 256 + i for i, name in enumerate(BYTE_SPECIALS)}
        self.bos_token_id: int | None = self.special_ids["<bos>"]
        self.eos_token_ids = [self.special_ids["<eos>"], self.special_ids["<|im_end|>"]]
        self.vocab_size = 256 + len(BYTE_SPECIALS)
        self.special_token_ids = sorted(self.special_ids.values())
        self.chat_template: str | None = BYTE_CHAT_TEMPLATE
        self._split = re.compile("(" + "|".join(re.escape(s) for s in BYTE_SPECIALS) + ")")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.special_ids["<bos>"]] if add_special_tokens else []
        for i, part in enumerate(self._split.split(text)):
            if i % 2:
                ids.append(self.special_ids[part])
            else:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return bytes([i for i in ids if 0 <= i < 256])

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if 256 <= token_id < self.vocab_size:
            return BYTE_SPECIALS[token_id - 256].encode()
        return self.decode_bytes([token_id])

    def tail_is_open(self, ids: Sequence[int]) -> bool:
        return False

    @functools.cached_property
    def whole_texts(self) -> list[str | None]:
        """Per id, its text when its bytes are whole characters by themselves (ASCII, or none:
        a special), else None: what ByteDetokenizer emits for it without decoding."""
        pieces = [self.decode_bytes((i,)) for i in range(self.vocab_size)]
        return [p.decode("ascii") if p.isascii() else None for p in pieces]

    def show_in_text(self, tokens: Sequence[str]) -> None:
        pass  # its specials are BOS, EOS and the turn markers

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        return render_chat_template(BYTE_CHAT_TEMPLATE, messages, add_generation_prompt, tools,
                                    bos_token="<bos>", eos_token="<eos>")


# ---- Hugging Face tokenizer.json


# The special tokens a chat template sees by name (transformers' special_tokens_map).
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")


class HFTokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, chat_template: str | None,
                 bos_token: str | None, eos_token: str | None,
                 extra_eos_ids: Sequence[int] = (), **template_tokens: str | None) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        named = {**template_tokens, "bos_token": bos_token, "eos_token": eos_token}
        self.template_tokens = {k: v for k, v in named.items() if v is not None}
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        eos = [tokenizer.token_to_id(eos_token)] if eos_token else []
        self.eos_token_ids = sorted({i for i in [*eos, *extra_eos_ids] if i is not None})
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        added = tokenizer.get_added_tokens_decoder()
        self._added_ids = frozenset(added)
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self.special_token_ids = sorted(self._special_ids)
        self._shown: frozenset[int] = frozenset()  # special ids decoded as text all the same
        self._byte_piece_ids = _byte_fallback_pieces(tokenizer)
        self._byte_level = isinstance(tokenizer.decoder, tokenizers.decoders.ByteLevel)
        # Decoding after a plain token keeps the leading space that SentencePiece's decoder
        # strips at the start of a string ("▁world" adds " world").
        self._anchor = tokenizer.encode("a", add_special_tokens=False).ids
        self._anchor_len = len(tokenizer.decode(self._anchor))

    @classmethod
    def from_dir(cls, path: Path, extra_eos_ids: Sequence[int] = ()) -> HFTokenizer:
        """Reads tokenizer.json, plus tokenizer_config.json and chat_template.jinja if present."""
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerLoadError(f"{tok_file}: missing (only tokenizer.json is supported)")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:
            raise TokenizerLoadError(f"{tok_file}: cannot be read: {e}") from e
        cfg = read_json_object(path / "tokenizer_config.json")
        template_file = path / "chat_template.jinja"
        template = (template_file.read_text() if template_file.is_file()
                    else _pick_template(cfg.get("chat_template")))
        named = {name: _token_text(cfg.get(name)) for name in TEMPLATE_TOKENS}
        return cls(tok, template, extra_eos_ids=extra_eos_ids, **named)

    @property
    def tokenizer_json(self) -> str | None:
        return str(self._tok.to_str())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        if self._shown:  # what skip_special_tokens does, sparing the shown ones
            kept = [i for i in ids if i not in self._special_ids or i in self._shown]
            return self._tok.decode(kept, skip_special_tokens=False)
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._byte_piece_ids:  # "<0xE6>"
            return bytes([int(piece[3:5], 16)])
        if self._byte_level and token_id not in self._added_ids:
            raw = [_BYTE_LEVEL_DECODER.get(c) for c in piece]
            if None not in raw:
                return bytes(b for b in raw if b is not None)
        text = self._tok.decode([*self._anchor, token_id], skip_special_tokens=False)
        return text[self._anchor_len :].encode()

    def tail_is_open(self, ids: Sequence[int]) -> bool:
        # Byte pieces decode as a group (valid UTF-8 as a whole, or U+FFFD for every one), and
        # skipped special tokens do not end a group.
        for token_id in reversed(ids):
            if token_id not in self._special_ids or token_id in self._shown:
                return token_id in self._byte_piece_ids
        return False

    def show_in_text(self, tokens: Sequence[str]) -> None:
        ids = {self._tok.token_to_id(token) for token in tokens}
        self._shown = self._shown | {i for i in ids if i in self._special_ids}

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template (no chat_template.jinja, "
                                    "no chat_template in tokenizer_config.json)")
        return render_chat_template(self.chat_template, messages, add_generation_prompt, tools,
                                    **self.template_tokens)


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for the 256 bytes (GPT-2's bytes_to_unicode)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    chars = {chr(b): b for b in printable}
    chars.update({chr(256 + i): b for i, b in enumerate(extra)})
    return chars


_BYTE_LEVEL_DECODER = byte_level_alphabet()


def _byte_fallback_pieces(tokenizer: tokenizers.Tokenizer) -> frozenset[int]:
    """The ids of SentencePiece's <0x00>..<0xFF> pieces, when the decoder turns them to bytes."""
    ids = [tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    if ids[0x41] is None or tokenizer.decode([ids[0x41]]) != "A":
        return frozenset()
    return frozenset(i for i in ids if i is not None)


def read_json_object(file: Path) -> dict[str, Any]:
    """A JSON object file; {} when the file is absent."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise TokenizerLoadError(f"{file}: cannot be read: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{file}: expected a JSON object")
    return data


def _pick_template(value: Any) -> str | None:
    if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value if isinstance(value, str) else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # a serialised AddedToken
        return value.get("content")
    return value if isinstance(value, str) else None


# ---- incremental detokenization


class IncrementalDetokenizer:
    """Feeds sampled ids one at a time; returns only text that can no longer change.

    Each push decodes a short window of ids: the last few already emitted (left context, since
    decoders such as SentencePiece's drop a leading space at the start of a string) and the new
    ones. Two things can still change as more ids follow, and are held back: one trailing U+FFFD
    (the bytes of an unfinished character; any earlier U+FFFD is final under lossy UTF-8
    decoding), and everything while the tokenizer says its tail is open (SentencePiece's byte
    pieces decode as a group, all or nothing). So the pieces add up to `decode` of the whole.
    """

    PROMPT_CONTEXT = 4
    MAX_WINDOW = 64  # ids kept before the window start is moved up on a long generation

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-self.PROMPT_CONTEXT :])
        self._prefix = 0  # window start: decode(ids[prefix:]) is what we diff against
        self._sent = len(tokenizer.decode(self._ids))  # chars of that decode already out

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is held back (with U+FFFD for broken bytes); call once at the end."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        window = self._ids[self._prefix :]
        if not final and self._tok.tail_is_open(window):
            return ""
        text = self._tok.decode(window)
        settled = final or not text.endswith("\ufffd")
        stable = text if settled else text[:-1]
        out = stable[self._sent :]
        self._sent = max(self._sent, len(stable))
        if settled and len(window) > self.PROMPT_CONTEXT:
            self._restart_window()
        return out

    def _restart_window(self) -> None:
        """Nothing is pending: the window restarts on the last ids, kept as context, unless they
        decode to no text (skipped special tokens), which would not keep a leading space."""
        start = len(self._ids) - self.PROMPT_CONTEXT
        sent = len(self._tok.decode(self._ids[start:]))
        if not sent:
            return
        self._prefix, self._sent = start, sent
        if self._prefix > self.MAX_WINDOW:
            del self._ids[: self._prefix]
            self._prefix = 0


class ByteDetokenizer:
    """IncrementalDetokenizer's pieces for the byte tokenizers (ByteTokenizer and the sim's),
    whose text is the UTF-8 of their ids' bytes: one decode per id, of the bytes since the text
    last settled, instead of two of a window of ids, and none for an id of whole characters
    once the text has settled (an ASCII byte, a sim word: nearly every id). Past a settled
    point (text not ending in U+FFFD: the last character is complete) decoding is
    concatenation, so dropping the ids before it changes no piece; the prompt's last ids start
    it, as they start the window."""

    def __init__(self, tokenizer: ByteTokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._bytes = tokenizer.decode_bytes
        self._whole = tokenizer.whole_texts
        self._pending = self._bytes(prompt_ids[-IncrementalDetokenizer.PROMPT_CONTEXT :])
        self._sent = len(self._pending.decode("utf-8", errors="replace"))

    def push(self, token_id: int) -> str:
        if not self._pending and 0 <= token_id < len(self._whole):
            # Settled text, and an id of whole characters: its text is the piece, no decode.
            text = self._whole[token_id]
            if text is not None:
                return text
        self._pending += self._bytes((token_id,))
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        text = self._pending.decode("utf-8", errors="replace")
        settled = final or not text.endswith("\ufffd")
        stable = text if settled else text[:-1]
        out = stable[self._sent :]
        if settled:
            self._pending, self._sent = b"", 0
        else:
            self._sent = max(self._sent, len(stable))
        return out


def incremental_detokenizer(tokenizer: Tokenizer,
                            prompt_ids: Sequence[int] = ()) -> IncrementalDetokenizer | ByteDetokenizer:
    """The cheapest detokenizer that gives `tokenizer`'s pieces."""
    if isinstance(tokenizer, ByteTokenizer):
        return ByteDetokenizer(tokenizer, prompt_ids)
    return IncrementalDetokenizer(tokenizer, prompt_ids)
