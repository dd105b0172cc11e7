"""What a prompt costs the tick before it is refused: a text with more bytes than the context's
tokens can spell is never tokenized, a long one is counted in pieces only until it is past the
context, and the pieces never count more than the slack over what the whole text holds (so no
prompt that fits is refused), on real vocabularies."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from daemon import prompts
from daemon.model.tokenizer import ByteTokenizer, HFTokenizer
from daemon.prompts import CUT_SLACK, encode_within, max_token_bytes, pieces
from daemon.rejected import ContextBytes

REPO = Path(__file__).parents[3]


class Counting(ByteTokenizer):
    """The byte tokenizer, counting the characters it is given to encode."""

    def __init__(self) -> None:
        super().__init__()
        self.encoded = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded += len(text)
        return super().encode(text, add_special_tokens)


def test_the_longest_token_bounds_the_bytes_a_context_holds() -> None:
    assert max_token_bytes(ByteTokenizer()) == len("<|im_start|>")


def test_a_text_with_more_bytes_than_the_context_can_spell_is_never_tokenized() -> None:
    tok = Counting()
    bound = ContextBytes(100, 12)
    assert encode_within(tok, "é" * 601, bound) == 1202
    assert tok.encoded == 0


def test_a_long_text_is_counted_only_until_it_is_past_the_context(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prompts, "PIECE_CHARS", 100)
    tok = Counting()
    text = "word " * 2_200  # 11,000 bytes, 11,000 tokens: under 12 x 1,000, over 8 x 1,000
    assert encode_within(tok, text, ContextBytes(1_000, 12)) == 11_000
    assert tok.encoded < 1_500  # the pieces up to the context's 1,000 tokens, not 11,000


def test_a_text_that_fits_is_tokenized_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prompts, "PIECE_CHARS", 100)
    monkeypatch.setattr(prompts, "DENSE_BYTES", 0)  # count in pieces first, however short
    tok = ByteTokenizer()
    text = "<|im_start|>user\nword word<|im_end|>\n" * 40
    assert encode_within(tok, text, ContextBytes(len(tok.encode(text, False)), 12)) == \
        tok.encode(text, add_special_tokens=False)


def _texts() -> list[str]:
    """Real text and code, and the shapes that could fool the cuts: runs of spaces, a word with
    no space at all, special tokens' text, newlines between words."""
    real = "".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    real += (REPO / "daemon" / "prompts.py").read_text()
    return [real, " " * 3_000 + "a" * 3_000 + " x" * 500, "<|im_start|>user\n" * 400,
            ("ab\n\ncd  \n" * 600), "é" * 2_000 + " 漢字" * 500]


@pytest.mark.parametrize("family", ["llama3", "spm", "qwen2", "gpt2", "phi3"])
def test_pieces_never_count_more_than_the_slack_over_the_whole(
        family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.real_tokenizers import tokenizer_dir

    tok = HFTokenizer.from_dir(tokenizer_dir(family))
    monkeypatch.setattr(prompts, "PIECE_CHARS", 200)  # many cuts
    for text in _texts():
        parts: Sequence[str] = list(pieces(text))
        assert "".join(reversed(parts)) == text
        counted = sum(len(tok.encode(p, add_special_tokens=False)) for p in parts)
        whole = len(tok.encode(text, add_special_tokens=False))
        assert counted <= whole + CUT_SLACK * (len(parts) - 1), (family, text[:40])


def test_the_bound_holds_for_the_longest_tokens_of_a_real_vocabulary() -> None:
    from tests.support.real_tokenizers import tokenizer_dir

    tok = HFTokenizer.from_dir(tokenizer_dir("llama3"))
    longest = max_token_bytes(tok)
    text = " " * (longest * 50)  # the vocabulary's longest tokens, each its most bytes
    assert len(tok.encode(text, add_special_tokens=False)) >= len(text.encode()) / longest
