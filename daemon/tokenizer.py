"""Tokenizers: a built-in byte tokenizer and Hugging Face tokenizer.json; chat templates.

Both implement `Tokenizer`. `IncrementalDetokenizer` turns a stream of sampled ids into text
pieces without ever splitting a multi-byte character (works for any `Tokenizer`).
"""

from __future__ import annotations

import datetime
import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TokenizerLoadError(ValueError):
    """A tokenizer file is missing or unreadable; the message names the file."""


class ChatTemplateError(ValueError):
    """No chat template, or the template failed on these messages."""


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_ids: list[int]
    vocab_size: int  # ids >= this never come out of encode and decode to nothing

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens=False for text from apply_chat_template (it has its own BOS)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Special tokens are skipped; invalid UTF-8 becomes U+FFFD."""
        ...

    def token_text(self, token_id: int) -> str:
        """One token decoded alone, special tokens included (for logprobs)."""
        ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str: ...


# ---- chat templates


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson HTML-escapes, which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    # Sandboxed: a checkpoint's template is untrusted code.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def render_chat_template(source: str, messages: list[dict[str, Any]],
                         add_generation_prompt: bool, **special: str | None) -> str:
    try:
        return _compile(source).render(messages=messages,
                                       add_generation_prompt=add_generation_prompt, **special)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e


# ---- built-in byte tokenizer

BYTE_SPECIALS = ("<bos>", "<eos>", "<|im_start|>", "<|im_end|>")
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ByteTokenizer:
    """Ids 0..255 are bytes, then <bos>, <eos>, <|im_start|>, <|im_end|> (ChatML-style chat)."""

    def __init__(self) -> None:
        self.special_ids = {name: 256 + i for i, name in enumerate(BYTE_SPECIALS)}
        self.bos_token_id: int | None = self.special_ids["<bos>"]
        self.eos_token_ids = [self.special_ids["<eos>"], self.special_ids["<|im_end|>"]]
        self.vocab_size = 256 + len(BYTE_SPECIALS)
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
        return bytes(i for i in ids if 0 <= i < 256)

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        if 256 <= token_id < self.vocab_size:
            return BYTE_SPECIALS[token_id - 256]
        return self.decode([token_id])

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str:
        return render_chat_template(BYTE_CHAT_TEMPLATE, messages, add_generation_prompt,
                                    bos_token="<bos>", eos_token="<eos>")


# ---- Hugging Face tokenizer.json


class HFTokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, chat_template: str | None,
                 bos_token: str | None, eos_token: str | None,
                 extra_eos_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        eos = [tokenizer.token_to_id(eos_token)] if eos_token else []
        self.eos_token_ids = sorted({i for i in [*eos, *extra_eos_ids] if i is not None})
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

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
        return cls(tok, template, _token_text(cfg.get("bos_token")),
                   _token_text(cfg.get("eos_token")), extra_eos_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template (no chat_template.jinja, "
                                    "no chat_template in tokenizer_config.json)")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token)


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

    Each push decodes a short window: from the last emitted boundary (kept as left context,
    since decoders such as SentencePiece's drop a leading space at the start of a string) to
    the newest id. Text ending in U+FFFD is an unfinished multi-byte character and is held
    back, up to MAX_HELD ids; past that the bytes are taken as truly invalid and released.
    """

    MAX_HELD = 16
    PROMPT_CONTEXT = 4

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-self.PROMPT_CONTEXT :])
        self._prefix = 0  # window start (context)
        self._read = len(self._ids)  # everything before this has been emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is held back (with U+FFFD for broken bytes); call once at the end."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        emitted = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        held = len(self._ids) - self._read
        if not final and text.endswith("\ufffd") and held < self.MAX_HELD:
            return ""
        if len(text) <= len(emitted):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix > 64:  # keep the id list short on long generations
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return text[len(emitted) :]
