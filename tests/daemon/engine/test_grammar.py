"""Grammars compiled from guides, their masks, and outputs that stay valid within max_tokens.

The property tests sample at temperature 1 from random logits, where a naive integration fails:
every output must parse and validate against its schema whatever the budget left."""

from __future__ import annotations

import json
import threading
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.engine.bitmask import Bitmask, apply_bitmask, fill_row
from daemon.engine.closing import SearchBound, closing
from daemon.engine.constraint import Constraint
from daemon.engine.grammar import SMALL_SPEC_BYTES, Compiled, GrammarError, Grammars, ascii_digits
from daemon.model.tokenizer import ByteTokenizer
from ipc.reasons import Reason
from ipc.records import Guide, GuideKind

TOK = ByteTokenizer()
EOS = TOK.eos_token_ids[0]


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(TOK, TOK.special_token_ids)


def schema_guide(schema: dict[str, Any]) -> Guide:
    return Guide(GuideKind.JSON_SCHEMA, json.dumps(schema), source="response_format")


def generate(grammars: Grammars, guide: Guide, max_tokens: int, seed: int) -> tuple[str, bool]:
    """Samples at temperature 1 from random logits under the guide; (text, ended with EOS)."""
    gen = torch.Generator().manual_seed(seed)
    constraint = Constraint(grammars, grammars.compile(guide).result())
    out: list[int] = []
    for step in range(max_tokens):
        logits = torch.randn(1, TOK.vocab_size, generator=gen) * 4
        bitmask = grammars.new_bitmask(1)
        constraint.fill(bitmask, 0)
        apply_bitmask(logits, [0], bitmask)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        token = constraint.accept(token, max_tokens - step)
        if token == EOS:
            return TOK.decode(out), True
        out.append(token)
    return TOK.decode(out), False


def test_each_kind_compiles_and_masks(grammars: Grammars) -> None:
    cases = {
        Guide(GuideKind.JSON_OBJECT): ("{", "x"),
        Guide(GuideKind.REGEX, r"[0-9]{3}-[a-z]+"): ("7", "a"),
        Guide(GuideKind.CHOICE, json.dumps(["yes", "no"])): ("y", "a"),
        Guide(GuideKind.GRAMMAR, 'start: "ab" | "cd"'): ("c", "b"),
        Guide(GuideKind.GRAMMAR, 'root ::= "ab" | "cd"'): ("a", "d"),  # GBNF
    }
    for guide, (allowed, forbidden) in cases.items():
        matcher = grammars.compile(guide).result().matcher
        assert matcher.validate_tokens([ord(allowed)]) == 1, guide
        assert matcher.validate_tokens([ord(forbidden)]) == 0, guide


def test_a_bad_guide_names_what_is_wrong(grammars: Grammars) -> None:
    with pytest.raises(GrammarError, match="uniqueItems"):  # a keyword not built
        grammars.compile(schema_guide({"type": "array", "uniqueItems": True})).result()
    with pytest.raises(GrammarError, match="notatype"):
        grammars.compile(schema_guide({"type": "notatype"})).result()
    with pytest.raises(GrammarError):
        grammars.compile(Guide(GuideKind.REGEX, "(unclosed")).result()
    with pytest.raises(GrammarError):
        grammars.compile(Guide(GuideKind.JSON_SCHEMA, "{not json")).result()
    # GBNF that llguidance's converter cannot read (it raises an error of its own, not a
    # ValueError: the fuzzer's grammar "0" once took the daemon down).
    for text in ["0", "root ::= (", "::="]:
        with pytest.raises(GrammarError):
            grammars.compile(Guide(GuideKind.GRAMMAR, text)).result()


def test_compiled_grammars_are_cached_within_their_bytes() -> None:
    small = Grammars(TOK, TOK.special_token_ids, cache_bytes=4096)
    guide = Guide(GuideKind.REGEX, "a+")
    small.compile(guide).result()
    small.compile(guide).result()
    assert (small.num_misses, small.num_hits) == (1, 1)
    for i in range(50):
        small.compile(Guide(GuideKind.REGEX, f"b{i}+")).result()
    assert 0 < small.num_cached_bytes <= 4096
    assert small.compile_obs and all(t >= 0 for t in small.take_compile_obs())


def test_the_closing_is_valid_from_anywhere(grammars: Grammars) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {
        "type": "array", "items": {"type": "integer"}}}, "required": ["a", "b"],
        "additionalProperties": False}
    matcher = grammars.compile(schema_guide(schema)).result().matcher
    for byte in b'{"a":"x\\"y","b":[1':
        assert matcher.consume_token(byte)
    tail = closing(matcher, grammars.byte_tokens, SearchBound.within(10_000, 60.0))
    assert isinstance(tail, bytes)
    jsonschema.validate(json.loads(b'{"a":"x\\"y","b":[1' + tail), schema)


def test_a_budget_too_small_for_any_output_is_infeasible(grammars: Grammars) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}},
              "required": ["name"]}
    constraint = Constraint(grammars, grammars.compile(schema_guide(schema)).result())
    assert not constraint.feasible(len('{"name":""}'))  # no room left for the end of sequence
    assert constraint.feasible(len('{"name":""}') + 1)


_leaf = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 12)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 1000)),
    st.just({"type": "boolean"}),
    st.just({"type": "number"}),
    st.just({"type": "string"}),  # unbounded: only the budget ends it
    st.builds(lambda vals: {"enum": vals},
              st.lists(st.text("abcxyz", min_size=1, max_size=6), min_size=1, max_size=4,
                       unique=True)),
)


def _object(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, dict[str, Any]], required: list[bool]) -> dict[str, Any]:
        names = list(props)
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": [n for n, r in zip(names, required, strict=False) if r]}
    return st.builds(build, st.dictionaries(st.text("abcdefgh", min_size=1, max_size=5),
                                            children, min_size=1, max_size=4),
                     st.lists(st.booleans(), min_size=4, max_size=4))


_schemas = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        _object(inner),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
                  inner, st.integers(0, 4))),
    max_leaves=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=_object(_schemas), max_tokens=st.integers(8, 160), seed=st.integers(0, 2**31))
def test_every_output_validates_within_its_budget(grammars: Grammars, schema: dict[str, Any],
                                                  max_tokens: int, seed: int) -> None:
    guide = schema_guide(schema)
    feasible = Constraint(grammars, grammars.compile(guide).result()).feasible(max_tokens)
    text, ended = generate(grammars, guide, max_tokens, seed)
    if not feasible:
        return  # refused at admission in the engine (tests/daemon/engine/test_guided.py)
    assert ended, f"ran out of its {max_tokens} tokens: {text!r}"
    jsonschema.validate(json.loads(text), schema)
    assert len(text.encode()) < max_tokens  # byte tokens; the end of sequence took one


def test_the_mask_computed_on_accepting_is_the_matcher_s_own(grammars: Grammars) -> None:
    constraint = Constraint(grammars, grammars.compile(schema_guide(
        {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}},
         "required": ["a"]})).result())
    ahead, fresh = grammars.new_bitmask(1), grammars.new_bitmask(1)
    assert not constraint.fill_known(ahead, 0)  # nothing consumed yet: the matcher's to say
    for byte in b'{"a":"x':
        token = grammars.byte_tokens[byte]
        constraint.fill(fresh, 0)
        assert fresh.allows(0, token) and not fresh.allows(0, EOS)
        assert constraint.accept(token, 40, allowed=True) == token
        constraint.compute_mask()
        assert constraint.fill_known(ahead, 0)
        fill_row(constraint.matcher, fresh, 0)
        assert ahead.words == fresh.words


def test_a_head_wider_than_the_vocabulary_masks_the_ids_past_it(grammars: Grammars) -> None:
    """builtin:small's head has 49,152 rows for the byte tokenizer's 260 ids (real checkpoints
    pad theirs too): the ids past the tokenizer are never allowed."""
    matcher = grammars.compile(Guide(GuideKind.REGEX, "a")).result()
    bitmask = grammars.new_bitmask(1)
    Constraint(grammars, matcher).fill(bitmask, 0)
    logits = torch.zeros(1, 49152)
    apply_bitmask(logits, [0], bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [ord("a")]


def test_a_head_wider_than_the_vocabulary_never_allows_the_padding() -> None:
    logits = torch.zeros(2, 100)  # a model's head padded past a 64-id vocabulary
    every = Bitmask(1, 2)
    every.tensor.fill_(-1)
    apply_bitmask(logits, [1], every)
    assert torch.all(logits[1, :64] == 0) and torch.all(logits[1, 64:] == float("-inf"))
    assert torch.all(logits[0] == 0)


@pytest.mark.parametrize("family", ["spm", "llama3"])
def test_real_vocabularies_keep_the_model_s_choice(family: str) -> None:
    """SentencePiece (a leading "▁" on the first piece of a string) and byte-level BPE: the
    grammar reads the tokenizer's own tokenizer.json, so a forced "{" is the "{" token and the
    outputs are sampled, not the bare closing every time."""
    from daemon.model.tokenizer import HFTokenizer
    from tests.support.real_tokenizers import tokenizer_dir

    tok = HFTokenizer.from_dir(tokenizer_dir(family))
    real = Grammars(tok, tok.special_token_ids)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    guide = schema_guide(schema)
    outputs = set()
    for seed in range(8):
        gen = torch.Generator().manual_seed(seed)
        constraint = Constraint(real, real.compile(guide).result())
        ids: list[int] = []
        for step in range(48):
            logits = torch.randn(1, tok.vocab_size, generator=gen) * 4
            bitmask = real.new_bitmask(1)
            constraint.fill(bitmask, 0)
            apply_bitmask(logits, [0], bitmask)
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            token = constraint.accept(token, 48 - step)
            if token in tok.eos_token_ids:
                break
            ids.append(token)
        else:
            raise AssertionError(f"ran out of tokens: {tok.decode(ids)!r}")
        text = tok.decode(ids)
        jsonschema.validate(json.loads(text), schema)
        outputs.add(text)
    assert len(outputs) >= 6, outputs


def _longest_closing_token(grammars: Grammars, constraint: Constraint) -> int:
    """Of the tokens the grammar allows now, the one after which the closing is longest."""
    bitmask = grammars.new_bitmask(1)
    constraint.fill(bitmask, 0)
    bits = ((bitmask.tensor[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
    best, best_len = EOS, -1
    for token in bits[:TOK.vocab_size].nonzero().flatten().tolist():
        if token == EOS:
            continue
        m = constraint.matcher.deep_copy()
        m.consume_token(token)
        tail = closing(m, grammars.byte_tokens, SearchBound.within(10_000, 60.0))
        if isinstance(tail, bytes) and len(tail) > best_len:
            best, best_len = token, len(tail)
    return best


@pytest.mark.parametrize("max_tokens", [14, 100, 220])
def test_a_sampler_that_always_grows_the_closing_still_ends_valid(grammars: Grammars,
                                                                  max_tokens: int) -> None:
    """One token can commit the output to a large required structure (a key whose object has
    twelve required fields): each such token is checked, however far the budget still is."""
    keys = "pqrstuvwxyzo"
    deep = {"type": "object", "additionalProperties": False, "required": list(keys),
            "properties": {k: {"type": "string", "minLength": 5} for k in keys}}
    schema = {"type": "object", "additionalProperties": False,
              "properties": {"n": {"type": "integer"}, "big": deep,
                             "list": {"type": "array", "items": deep}}}
    constraint = Constraint(grammars, grammars.compile(schema_guide(schema)).result())
    assert constraint.feasible(max_tokens)
    out: list[int] = []
    for step in range(max_tokens):
        token = constraint.accept(_longest_closing_token(grammars, constraint), max_tokens - step)
        if token == EOS:
            break
        out.append(token)
    else:
        raise AssertionError(f"ran out of its {max_tokens} tokens: {TOK.decode(out)!r}")
    jsonschema.validate(json.loads(TOK.decode(out)), schema)


def test_the_first_closing_is_compiled_and_cached_with_the_grammar() -> None:
    fresh = Grammars(TOK, TOK.special_token_ids)
    guide = schema_guide({"type": "object", "properties": {"a": {"type": "integer"}},
                          "required": ["a"], "additionalProperties": False})
    first = fresh.compile(guide).result()
    again = fresh.compile(guide).result()
    assert first.start == again.start and first.start.text == b'{"a":0}'
    assert (fresh.num_misses, fresh.num_hits) == (1, 1)
    assert again.matcher is not first.matcher  # each request advances its own


def test_a_grammar_whose_output_cannot_be_bounded_is_refused_once() -> None:
    """No closing within the search's bound: refused naming the limit, and the refusal is
    cached (a client repeating it costs no second search)."""
    fresh = Grammars(TOK, TOK.special_token_ids)
    guide = Guide(GuideKind.GRAMMAR, 'start: "<" e "!"\ne: e e | "<" e "!" | /[a-z]/ | ""')
    for _ in range(2):
        with pytest.raises(GrammarError, match="limit") as info:
            fresh.compile(guide).result(timeout=30)
        assert info.value.reason is Reason.GRAMMAR_TOO_COMPLEX
    assert (fresh.num_misses, fresh.num_hits) == (1, 1)


def test_a_slow_compile_does_not_hold_up_a_small_one() -> None:
    """A large spec compiles in a lane of its own: held there, a small one still compiles."""
    release = threading.Event()

    class Held(Grammars):
        def _build(self, guide: Guide) -> Compiled:
            if len(guide.spec) > SMALL_SPEC_BYTES:
                release.wait(30)
            return super()._build(guide)

    held = Held(TOK, TOK.special_token_ids)
    props = {f"p{i}": {"type": "integer"} for i in range(SMALL_SPEC_BYTES // 20)}
    large = held.compile(schema_guide({"type": "object", "properties": props}))
    small = held.compile(schema_guide({"type": "integer"}))
    assert small.result(timeout=30).start.text == b"0"
    assert not large.done()
    release.set()
    with pytest.raises(GrammarError, match="parser items"):  # 900 optional properties
        large.result(timeout=60)


def test_a_grammar_of_too_many_symbols_is_refused_at_compile_naming_the_limit(
        grammars: Grammars) -> None:
    """An object of 8,000 optional properties is 25,000-odd symbols: refused by the symbol
    bound before its rows are ever built (they would hold the GIL for a third of a second each),
    where one of 2,000 still compiles."""
    def schema(n: int) -> Guide:
        props = {f"p{k}": {"type": "string"} for k in range(n)}
        return Guide(GuideKind.JSON_SCHEMA, json.dumps({"type": "object", "properties": props}))

    with pytest.raises(GrammarError, match="too big"):
        grammars.compile(schema(8000)).result()
    with pytest.raises(GrammarError, match="parser limits"):  # compiled, then its first row
        grammars.compile(schema(2000)).result()


@pytest.mark.parametrize(("regex", "ascii"), [
    (r"\d{4}-\d\d", "[0-9]{4}-[0-9][0-9]"), (r"[\d_]+", "[0-9_]+"), (r"\D", "[^0-9]"),
    (r"\\d", r"\\d"), (r"[]\d]", "[]0-9]"), (r"[^]\d]\d", "[^]0-9][0-9]"), (r"\w\s", r"\w\s"),
])
def test_a_regex_guide_reads_d_as_ascii_digits(regex: str, ascii: str) -> None:
    assert ascii_digits(regex) == ascii


def test_a_regex_guide_allows_no_other_script_s_digits(grammars: Grammars) -> None:
    """As JSON Schema's patterns (ECMA-262) and outlines read it: a random-weight answer to
    \\d{4}-\\d\\d-\\d\\d once held U+10D43, which Python's re does not take for a digit."""
    matcher = grammars.compile(Guide(GuideKind.REGEX, r"\d\d")).result().matcher
    assert matcher.validate_tokens(list("\u0660".encode())) == 0  # ARABIC-INDIC DIGIT ZERO
    assert matcher.validate_tokens([ord("7"), ord("3")]) == 2
