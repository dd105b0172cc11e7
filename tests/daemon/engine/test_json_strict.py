"""Every JSON a grammar lets through is RFC 8259 JSON: no NaN or Infinity, no invalid escape, no
lone surrogate, no raw control character, UTF-8 throughout. The matcher is driven with tokens
drawn uniformly from those its mask allows on real vocabularies (byte-level BPE, SentencePiece
with byte fallback), which favours the odd token a model would rarely pick, through each
path: json_object, json_schema, and the arguments of a forced tool call."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.engine.constraint import Constraint
from daemon.engine.grammar import Grammars
from daemon.engine.json_numbers import NumberGuard, guards_numbers
from daemon.model.tokenizer import HFTokenizer
from ipc.records import Guide, GuideKind, ToolCallFormat, ToolFunction
from proxy.tool_calls import ToolUse
from tests.proxy.tool_calls.test_parsers import merged, parse
from tests.support.real_tokenizers import tokenizer_dir

pytestmark = pytest.mark.timeout(600)


def strict(raw: bytes) -> Any:
    """The JSON value of `raw`, or an AssertionError saying what RFC 8259 does not allow."""
    text = raw.decode("utf-8")  # a JSON text is UTF-8; strict: no replacement characters

    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} is not JSON: {text!r}")

    value = json.loads(text, parse_constant=refuse)  # strict: no raw control characters
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        raise AssertionError(f"a number overflows binary64 (Infinity): {text!r}") from None
    _no_lone_surrogates(value, text)
    return value


def _no_lone_surrogates(value: Any, text: str) -> None:
    if isinstance(value, str):
        value.encode("utf-8")  # raises on a lone surrogate escaped as \uD800
    elif isinstance(value, dict):
        for key, item in value.items():
            _no_lone_surrogates(key, text)
            _no_lone_surrogates(item, text)
    elif isinstance(value, list):
        for item in value:
            _no_lone_surrogates(item, text)


class Vocab:
    def __init__(self, family: str) -> None:
        self.tok = HFTokenizer.from_dir(tokenizer_dir(family))
        self.grammars = Grammars(self.tok, self.tok.special_token_ids)
        self.shifts = torch.arange(32, dtype=torch.int32)

    def walk(self, guide: Guide, max_tokens: int, seed: int) -> bytes:
        """The bytes of one output, each token drawn uniformly from those allowed."""
        rng = random.Random(seed)
        grammars = self.grammars
        constraint = Constraint(grammars, grammars.compile(guide).result(),
                                NumberGuard() if guards_numbers(guide) else None)
        out: list[bytes] = []
        for step in range(max_tokens):
            bitmask = grammars.new_bitmask(1)
            constraint.fill(bitmask, 0)
            bits = (bitmask.tensor[0].unsqueeze(-1) >> self.shifts) & 1
            allowed = bits.flatten()[:self.tok.vocab_size].nonzero().flatten().tolist()
            token = constraint.accept(rng.choice(allowed), max_tokens - step, allowed=True)
            if token in self.tok.eos_token_ids:
                return b"".join(out)
            out.append(self.tok.token_bytes(token))
        raise AssertionError(f"ran out of its {max_tokens} tokens: {b''.join(out)!r}")


@pytest.fixture(scope="module", params=["llama3", "spm"])
def vocab(request: pytest.FixtureRequest) -> Vocab:
    return Vocab(request.param)


_value = st.deferred(lambda: st.one_of(
    st.just({"type": "number"}), st.just({"type": "integer"}), st.just({"type": "string"}),
    st.just({}),  # any JSON value
    st.builds(lambda items: {"type": "array", "items": items, "maxItems": 3}, _value),
    st.builds(lambda props: {"type": "object", "properties": props}, st.dictionaries(
        st.text("abc", min_size=1, max_size=3), _value, max_size=3))))

_guides = st.one_of(
    st.just(Guide(GuideKind.JSON_OBJECT, source="response_format")),
    st.builds(lambda s: Guide(GuideKind.JSON_SCHEMA, json.dumps(s), "response_format"), _value))

_settings = settings(max_examples=20, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow,
                                            HealthCheck.function_scoped_fixture])


@_settings
@given(guide=_guides, max_tokens=st.integers(8, 160), seed=st.integers(0, 2**31))
def test_json_outputs_are_rfc_8259(vocab: Vocab, guide: Guide, max_tokens: int,
                                   seed: int) -> None:
    if not Constraint(vocab.grammars, vocab.grammars.compile(guide).result()).feasible(
            max_tokens):
        return  # refused up front: max_tokens too small
    value = strict(vocab.walk(guide, max_tokens, seed))
    if guide.kind is GuideKind.JSON_OBJECT:
        assert isinstance(value, dict)


@_settings
@given(schema=_value, fmt=st.sampled_from(list(ToolCallFormat)),
       max_tokens=st.integers(40, 200), seed=st.integers(0, 2**31))
def test_tool_call_arguments_are_rfc_8259(vocab: Vocab, schema: dict[str, Any],
                                          fmt: ToolCallFormat, max_tokens: int,
                                          seed: int) -> None:
    params = schema if schema.get("type") == "object" else {
        "type": "object", "properties": {"x": schema}, "required": ["x"]}
    tools = (ToolFunction("f", parameters=json.dumps(params)),)
    guide = ToolUse(tools, "required", tools, False).guide(fmt, None)
    assert guide is not None
    if not Constraint(vocab.grammars, vocab.grammars.compile(guide).result()).feasible(
            max_tokens):
        return
    raw = vocab.walk(guide, max_tokens, seed)
    _, calls = merged(parse(fmt, [raw.decode("utf-8")], ("f",), False))
    assert len(calls) == 1, raw
    assert isinstance(strict(calls[0][2].encode()), dict)
