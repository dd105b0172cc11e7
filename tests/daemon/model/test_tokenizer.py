"""Byte and HF tokenizers, incremental detokenization, chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from daemon.model.chat_template import tool_call_format
from daemon.model.tokenizer import (
    BYTE_SPECIALS,
    ByteDetokenizer,
    ByteTokenizer,
    ChatTemplateError,
    HFTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerLoadError,
)
from tests.support.checkpoints import CHAT_TEMPLATE, CORPUS

BYTES = ByteTokenizer()
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]


def stream(tokenizer: Tokenizer, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt or [])
    pieces = [detok.push(i) for i in ids]
    return [*pieces, detok.flush()]


@pytest.fixture(scope="module")
def hf(hf_tokenizer_dir: Path) -> HFTokenizer:
    return HFTokenizer.from_dir(hf_tokenizer_dir)


@given(st.text())
def test_byte_tokenizer_roundtrips_any_text(text: str) -> None:
    assume(not any(special in text for special in BYTE_SPECIALS))  # those become special ids
    ids = BYTES.encode(text, add_special_tokens=False)
    assert all(0 <= i < 256 for i in ids)
    assert BYTES.decode(ids) == text


def test_byte_tokenizer_maps_special_strings_to_ids() -> None:
    ids = BYTES.encode("a<|im_end|>b")
    assert ids == [BYTES.bos_token_id, ord("a"), 259, ord("b")]
    assert BYTES.decode(ids) == "ab"  # specials are not text
    assert 259 in BYTES.eos_token_ids and BYTES.vocab_size == 260


# Excluded from the input: U+FFFD (what a broken character decodes to), surrogates (not UTF-8)
# and "<" (special-token strings such as "<|im_start|>" encode to special ids, not text).
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",),
                                      blacklist_characters="\ufffd<")))
def test_incremental_detok_of_valid_text_never_emits_a_broken_char(text: str) -> None:
    pieces = stream(BYTES, BYTES.encode(text, add_special_tokens=False))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    assert pieces[-1] == ""  # nothing was left to flush


@given(st.binary(max_size=64))
def test_incremental_detok_of_any_bytes_equals_one_shot_decode(data: bytes) -> None:
    pieces = stream(BYTES, list(data))
    assert "".join(pieces) == data.decode("utf-8", errors="replace")


def test_incremental_detok_holds_a_split_character_until_complete() -> None:
    euro = list("€".encode())
    assert stream(BYTES, [ord("a"), *euro, ord("b")]) == ["a", "", "", "€", "b", ""]


def test_incremental_detok_holds_only_the_unfinished_character() -> None:
    # Every lead byte but the last is followed by a non-continuation byte: already invalid.
    detok = IncrementalDetokenizer(BYTES)
    assert [detok.push(0xE2) for _ in range(40)] == ["", *["\ufffd"] * 39]
    assert [detok.push(b) for b in (0x82, 0xAC)] == ["", "€"]  # the last one completes


def test_incremental_detok_of_bytes_completing_after_a_long_invalid_run() -> None:
    ids = [0xE6] * 20 + list("日".encode())[1:]
    assert "".join(stream(BYTES, ids)) == bytes(ids).decode(errors="replace")


@settings(max_examples=300)
@given(st.lists(st.sampled_from([0x61, 0x20, 0xE2, 0x82, 0xAC, 0xE6, 0x97, 0xA5, 0xF0, 0x9F,
                                 0x98, 0x80, 0xFF, 0x80, 256, 257]), max_size=12),
       st.lists(st.sampled_from([0x61, 0x20, 0xE2, 0x82, 0xAC, 0xE6, 0x97, 0xA5, 0xF0, 0x9F,
                                 0x98, 0x80, 0xFF, 0x80, 256, 257]), max_size=40))
def test_byte_detok_gives_the_incremental_detoks_pieces(prompt: list[int],
                                                        ids: list[int]) -> None:
    # Piece by piece, flush included, whatever the prompt's tail leaves unfinished.
    window, lookup = IncrementalDetokenizer(BYTES, prompt), ByteDetokenizer(BYTES, prompt)
    assert [lookup.push(i) for i in ids] == [window.push(i) for i in ids]
    assert lookup.flush() == window.flush()


def test_incremental_detok_skips_eos() -> None:
    assert "".join(stream(BYTES, [ord("o"), ord("k"), *BYTES.eos_token_ids])) == "ok"


def test_byte_chat_template_renders_chatml() -> None:
    text = BYTES.apply_chat_template(MESSAGES)
    assert text == ("<bos><|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n")
    ids = BYTES.encode(text, add_special_tokens=False)
    assert ids.count(258) == 3 and ids[0] == BYTES.bos_token_id
    assert not BYTES.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("\n\n")


def test_hf_tokenizer_roundtrip_and_bos(hf: HFTokenizer) -> None:
    for text in CORPUS:
        ids = hf.encode(text)
        assert ids[0] == hf.bos_token_id == 0
        assert hf.decode(ids) == text
        assert hf.encode(text, add_special_tokens=False) == ids[1:]
    assert hf.eos_token_ids == [1] and hf.vocab_size == 300


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet="hello wörld日本語🙂🚀, ", max_size=40))
def test_hf_incremental_detok_never_emits_a_broken_char(hf: HFTokenizer, text: str) -> None:
    prompt = hf.encode("the quick")
    pieces = stream(hf, hf.encode(text, add_special_tokens=False), prompt)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_hf_chat_template_from_tokenizer_config(hf: HFTokenizer) -> None:
    assert hf.chat_template == CHAT_TEMPLATE
    text = hf.apply_chat_template(MESSAGES)
    assert text == "[system] Be brief.</s>[user] Hi 🙂</s>[assistant] "


def test_chat_template_jinja_file_wins(hf_tokenizer_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((hf_tokenizer_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content | tojson }}{% endfor %}")
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == (
        '"Be brief.""Hi 🙂"')


def test_chat_template_errors_are_chat_template_errors(hf_tokenizer_dir: Path,
                                                       tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((hf_tokenizer_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ChatTemplateError, match="no chat template"):
        HFTokenizer.from_dir(tmp_path).apply_chat_template(MESSAGES)
    templates = {
        "{{ raise_exception('roles must alternate') }}": "roles must alternate",
        "{{ messages.__class__.__mro__ }}": "chat template failed",  # sandboxed
        "{% for %}": "does not compile",
    }
    for source, message in templates.items():
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source}))
        with pytest.raises(ChatTemplateError, match=message):
            HFTokenizer.from_dir(tmp_path).apply_chat_template(MESSAGES)


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match=r"tokenizer\.json: missing"):
        HFTokenizer.from_dir(tmp_path)


def test_incremental_detok_over_a_long_generation(hf: HFTokenizer) -> None:
    text = "".join(CORPUS) * 20  # long enough for the id window to be trimmed many times
    pieces = stream(hf, hf.encode(text, add_special_tokens=False))
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


# ---- tools

TOOL = {"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}


def test_byte_chat_template_offers_tools_and_writes_calls_as_hermes() -> None:
    calls = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "tool_calls": [
                 {"id": "c1", "type": "function",
                  "function": {"name": "get", "arguments": {"q": "x"}}},
                 {"id": "c2", "type": "function", "function": {"name": "get", "arguments": {}}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    text = BYTES.apply_chat_template([MESSAGES[0], *calls], tools=[TOOL])
    assert text.startswith("<bos><|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '\n<tools>\n{"type": "function", "function": {"name": "get"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get", "arguments": {"q": "x"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get", "arguments": {}}\n</tool_call><|im_end|>'
            '\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n') in text
    assert text.count("<|im_start|>system") == 1  # the system turn is the tools' turn
    assert BYTES.apply_chat_template(MESSAGES, tools=None) == BYTES.apply_chat_template(MESSAGES)


def test_tool_call_format_follows_the_template() -> None:
    assert tool_call_format(BYTES.chat_template) == "hermes"
    assert tool_call_format("{{ '[TOOL_CALLS][' }}") == "mistral"
    assert tool_call_format('Respond in the format {"name": function name, "parameters": '
                            'dictionary of argument name and its value}') == "llama3_json"
    assert tool_call_format(CHAT_TEMPLATE) is None and tool_call_format(None) is None


def test_special_tokens_shown_in_text_decode_as_text(hf: HFTokenizer) -> None:
    special = next(i for i in hf.special_token_ids if i not in hf.eos_token_ids)
    name = hf._tok.id_to_token(special)
    ids = [special, *hf.encode("hi", add_special_tokens=False)]
    assert hf.decode(ids) == "hi"
    shown = HFTokenizer(hf._tok, hf.chat_template, hf.bos_token, hf.eos_token)
    shown.show_in_text([name, "<not a token>"])
    assert shown.decode(ids) == name + "hi"
    assert "".join(stream(shown, ids)) == name + "hi"
    assert shown.decode([*hf.eos_token_ids, *ids[1:]]) == "hi"  # the others are still skipped
