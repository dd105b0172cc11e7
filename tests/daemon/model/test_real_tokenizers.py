"""tether's tokenizer layer against the tokenizers real checkpoints ship, with transformers as the
reference: Llama 3 byte-level BPE, Llama 2 / Mistral SentencePiece with byte fallback, Qwen2, GPT-2.

The files come from a package registry in the test setup (tests/support/real_tokenizers.py)."""

from __future__ import annotations

import functools
from typing import Any

import jinja2
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from daemon.engine.stops import StopMatcher
from daemon.model.tokenizer import ChatTemplateError, HFTokenizer, IncrementalDetokenizer
from daemon.prompts import single_tool_call
from tests.support.real_tokenizers import FAMILIES, chat_templates, reference, tokenizer_dir

pytestmark = pytest.mark.timeout(600)

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "日本語のテキストと中文文本\uff0c还有한국어 텍스트。",
    "emoji 🙂🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽 keycap 1️⃣",
    "combining: e\u0301 a\u0300\u0323 Tiếng Việt, देवनागरी, ภาษาไทย, Ελληνικά",
    "العربية והעברית mixed with ASCII; math ∑∫√∞ ≠ ≤",
    "def f(x):\n    return {'a': x ** 2}  # tabs\tand  spaces\n\n",
    "  leading and trailing spaces  ",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi 🙂"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "日本語?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke."}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}],
]
BAD_ORDERS = [
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}],
    [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}],
]


class Pair:
    """tether's tokenizer and transformers' for one family."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ours = HFTokenizer.from_dir(tokenizer_dir(name))
        self.ref = reference(name)
        vocab = self.ref.get_vocab()
        self.vocab_size = len(self.ref)
        self.special_ids = sorted(set(self.ref.all_special_ids) | {
            i for i, t in self.ref.added_tokens_decoder.items() if t.special})
        # Pieces that are one raw byte: byte-level BPE's 256 single characters, SentencePiece's
        # <0xNN> fallback pieces. Streams of them split characters anywhere.
        self.byte_ids = sorted({i for t, i in vocab.items()
                                if len(t) == 1 and t in _BYTE_LEVEL_CHARS}
                               | {i for t, i in vocab.items() if _is_byte_piece(t)})

    def decode(self, ids: list[int]) -> str:
        text: str = self.ref.decode(ids, skip_special_tokens=True)
        return text


_BYTE_LEVEL_CHARS = {chr(c) for c in [*range(33, 127), *range(161, 173), *range(174, 256),
                                      *range(256, 256 + 68)]}


def _is_byte_piece(token: str) -> bool:
    return len(token) == 6 and token.startswith("<0x") and token.endswith(">")


@functools.cache
def load(name: str) -> Pair:
    return Pair(name)


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request: pytest.FixtureRequest) -> Pair:
    return load(request.param)


def stream(pair: Pair, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(pair.ours, prompt or [])
    return [*(detok.push(i) for i in ids), detok.flush()]


def continuation(pair: Pair, prompt: list[int], ids: list[int]) -> str:
    """What `ids` add to the text after `prompt`, by transformers' decode of the whole."""
    head, whole = pair.decode(prompt), pair.decode(prompt + ids)
    assert whole.startswith(head), (head, whole)
    return whole[len(head):]


# ---- streaming detokenization


def token_streams(pair: Pair) -> st.SearchStrategy[list[int]]:
    return st.lists(st.one_of(
        st.integers(0, pair.vocab_size - 1),
        st.sampled_from(pair.byte_ids),
        st.sampled_from(pair.special_ids),
    ), max_size=40)


def test_stream_equals_decode_of_random_ids(pair: Pair) -> None:
    prompt = pair.ref.encode("Once upon a time", add_special_tokens=False)

    # Found here: SentencePiece's "▁▁", then skipped specials, then "▁l" (the window must keep
    # text as its left context, or the decoder strips the next leading space).
    spaces = pair.ref.convert_tokens_to_ids(["▁▁", "▁l"]) if pair.name == "spm" else []

    @settings(max_examples=150, suppress_health_check=list(HealthCheck), deadline=None)
    @example([spaces[0], *[pair.special_ids[0]] * 4, spaces[1]] if spaces else [])
    @given(token_streams(pair))
    def check(ids: list[int]) -> None:
        assert "".join(stream(pair, ids)) == pair.decode(ids)
        assert "".join(stream(pair, ids, prompt)) == continuation(pair, prompt, ids)

    check()


@pytest.mark.parametrize("text", TEXTS)
def test_stream_of_multilingual_text(pair: Pair, text: str) -> None:
    ids = pair.ref.encode(text, add_special_tokens=False)
    assert pair.ours.encode(text, add_special_tokens=False) == ids
    assert pair.ours.encode(text) == pair.ref.encode(text)  # BOS where the family adds one
    pieces = stream(pair, ids)
    assert "".join(pieces) == pair.decode(ids)
    assert all("\ufffd" not in p for p in pieces), pieces
    prompt = pair.ref.encode("Answer:", add_special_tokens=False)
    assert "".join(stream(pair, ids, prompt)) == continuation(pair, prompt, ids)


# ---- logprob tokens


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_add_up_to_the_text(pair: Pair, text: str) -> None:
    """What logprobs report per token: joined, exactly the text the tokens continue with."""
    prompt = pair.ref.encode("Answer:", add_special_tokens=False)
    ids = pair.ref.encode(text, add_special_tokens=False)
    raw = [pair.ours.token_bytes(i) for i in ids]
    assert b"".join(raw) == continuation(pair, prompt, ids).encode()
    for token_id, token in zip(ids, raw, strict=True):  # whole characters decode alone
        if token.decode(errors="ignore").encode() == token:
            assert pair.decode([*prompt, token_id]) == pair.decode(prompt) + token.decode()


def test_special_token_bytes_are_their_names(pair: Pair) -> None:
    for token_id in pair.special_ids:
        assert pair.ours.token_bytes(token_id) == pair.ref.convert_ids_to_tokens(token_id).encode()


# ---- stop strings


def stop_output(pair: Pair, ids: list[int], stop: str, prompt: list[int]) -> tuple[str, bool]:
    detok, stops = IncrementalDetokenizer(pair.ours, prompt), StopMatcher([stop])
    out = ""
    for token in ids:
        out += stops.push(detok.push(token))
        if stops.stopped:
            return out, True
    out += stops.push(detok.flush())
    return out + stops.flush(), stops.stopped


@pytest.mark.parametrize("text", TEXTS[:5])
def test_stop_strings_straddling_tokens(pair: Pair, text: str) -> None:
    prompt = pair.ref.encode("Answer:", add_special_tokens=False)
    ids = pair.ref.encode(text, add_special_tokens=False)
    full = continuation(pair, prompt, ids)
    # Every boundary between tokens that each release text, with a stop string reaching two
    # characters to either side of it.
    offsets, pos = [], 0
    for piece in stream(pair, ids, prompt)[:-1]:
        pos += len(piece)
        if piece and 2 <= pos <= len(full) - 2:
            offsets.append(pos)
    assert offsets
    for at in offsets:
        stop = full[at - 2: at + 2]
        out, stopped = stop_output(pair, ids, stop, prompt)
        assert stopped and out == full[:full.find(stop)], (stop, out)


# ---- chat templates


def ours_or_error(pair: Pair, messages: list[dict[str, Any]], agp: bool,
                  tools: list[dict[str, Any]] | None = None) -> str | type:
    try:
        return pair.ours.apply_chat_template(messages, add_generation_prompt=agp, tools=tools)
    except ChatTemplateError:
        return ChatTemplateError


def theirs_or_error(pair: Pair, messages: list[dict[str, Any]], agp: bool,
                    tools: list[dict[str, Any]] | None = None) -> str | type:
    try:
        text: str = pair.ref.apply_chat_template(messages, tokenize=False, tools=tools,
                                                 add_generation_prompt=agp)
        return text
    except (jinja2.TemplateError, ValueError):
        return ChatTemplateError


@pytest.mark.parametrize("agp", [True, False])
def test_chat_template_renders_as_transformers(pair: Pair, agp: bool) -> None:
    for messages in CONVERSATIONS + BAD_ORDERS:
        assert ours_or_error(pair, messages, agp) == theirs_or_error(pair, messages, agp), messages
    if pair.ours.chat_template is None:
        return
    for messages in CONVERSATIONS:  # the prompt tokens a chat request is served with
        if theirs_or_error(pair, messages, True) is ChatTemplateError:
            continue  # Gemma 2's template refuses a system turn (both refuse, checked above)
        text = pair.ours.apply_chat_template(messages)
        assert pair.ours.encode(text, add_special_tokens=False) == pair.ref.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False)


def test_families_cover_templates_that_raise_and_none() -> None:
    raised = {name for name in FAMILIES
              if ours_or_error(load(name), BAD_ORDERS[0], True) is ChatTemplateError}
    assert "spm" in raised and "gpt2" in raised  # Mistral's raises; GPT-2 has none


def test_every_llama_cpp_template_renders_as_transformers() -> None:
    """Seventy real checkpoints' templates, each rendered both ways with the same specials."""
    pair = load("qwen2")
    mismatched = {}
    for name, source in chat_templates().items():
        ours = HFTokenizer(pair.ours._tok, source, **pair.ours.template_tokens)
        for messages in CONVERSATIONS[1:3] + BAD_ORDERS[:1]:
            try:
                mine: str | type = ours.apply_chat_template(messages)
            except ChatTemplateError:
                mine = ChatTemplateError
            try:
                theirs: str | type = pair.ref.apply_chat_template(
                    messages, chat_template=source, tokenize=False, add_generation_prompt=True)
            except Exception:
                theirs = ChatTemplateError
            if mine != theirs:
                mismatched[name] = (messages, mine, theirs)
    assert not mismatched, mismatched


def test_the_templates_that_take_one_call_a_turn_are_found() -> None:
    """Llama 3.1 to 3.3's raise for an assistant turn of several calls: found by rendering a
    turn of one and one of two, so the proxy never asks such a model for two. Every other
    template of the seventy takes several, or renders no call at all (nothing is known)."""
    pair = load("qwen2")
    single = {name for name, source in chat_templates().items()
              if single_tool_call(HFTokenizer(pair.ours._tok, source,
                                              **pair.ours.template_tokens))}
    assert single == {"meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct",
                      "meta-llama-Llama-3.3-70B-Instruct"}
    assert all("only supports single tool-calls" in chat_templates()[name] for name in single)


# ---- tools: offered, called and answered, rendered as transformers renders them

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city, now.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]


def _tool_conversations() -> list[list[dict[str, Any]]]:
    """Chat messages as the daemon hands them to a template (daemon/prompts.py)."""
    from daemon.prompts import template_message
    from ipc.records import Message, ToolCall

    ask = [Message("system", "You help."), Message("user", "Weather in Paris and the time?")]
    one = ToolCall("call00001", "get_weather", '{"city": "Paris", "unit": "celsius"}')
    two = ToolCall("call00002", "get_time", '{"zone": "CET"}')
    answered = [*ask, Message("assistant", None, [one]),
                Message("tool", '{"temperature": 21}', tool_call_id="call00001")]
    parallel = [*ask, Message("assistant", None, [one, two]),
                Message("tool", '{"temperature": 21}', tool_call_id="call00001"),
                Message("tool", '"14:00"', tool_call_id="call00002"),
                Message("assistant", "21 degrees, and it is two."), Message("user", "Thanks!")]
    return [[template_message(m) for m in conversation]
            for conversation in (ask, answered, parallel)]


def test_tools_render_as_transformers_in_every_llama_cpp_template() -> None:
    """The seventy templates with tools offered, called and answered: each renders as
    transformers' apply_chat_template(tools=...) renders it (or both refuse)."""
    pair = load("qwen2")
    mismatched = {}
    rendered_tools = 0
    for name, source in chat_templates().items():
        ours = HFTokenizer(pair.ours._tok, source, **pair.ours.template_tokens)
        for messages in _tool_conversations():
            try:
                mine: str | type = ours.apply_chat_template(messages, tools=TOOLS)
            except ChatTemplateError:
                mine = ChatTemplateError
            try:
                theirs: str | type = pair.ref.apply_chat_template(
                    messages, tools=TOOLS, chat_template=source, tokenize=False,
                    add_generation_prompt=True)
            except Exception:
                theirs = ChatTemplateError
            if mine != theirs:
                mismatched[name] = (messages, mine, theirs)
            rendered_tools += isinstance(mine, str) and "get_weather" in mine
    assert not mismatched, mismatched
    assert rendered_tools > 60  # most real templates offer the tools; a few refuse the turns


@pytest.mark.parametrize("name", ["qwen2", "llama3", "spm", "qwen3", "smollm3", "granite"])
def test_tools_render_as_transformers_in_the_families(name: str) -> None:
    pair = load(name)
    for messages in _tool_conversations():
        assert ours_or_error(pair, messages, True, TOOLS) == theirs_or_error(
            pair, messages, True, TOOLS), (name, messages)


def test_qwen3_renders_an_assistant_turn_of_calls_alone() -> None:
    """Codex CLI's second turn: the instructions, then a call with no text. Qwen3's template
    reads `message.content`, which the daemon gives it as "" (transformers refuses None)."""
    pair = load("qwen3")
    messages = _tool_conversations()[1]
    assert messages[2]["content"] == ""
    mine = ours_or_error(pair, messages, True, TOOLS)
    assert mine == theirs_or_error(pair, messages, True, TOOLS)
    assert isinstance(mine, str)
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Paris", "unit": "celsius"}}\n</tool_call><|im_end|>' in mine
