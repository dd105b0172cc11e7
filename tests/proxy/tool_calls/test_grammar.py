"""Forced tool calls (tool_choice required or named) through the daemon's grammar engine, sampled
at temperature 1 from random logits: every output is calls in the format, of the functions
forced, whose arguments validate against their parameters, closed within max_tokens."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.engine.constraint import Constraint
from daemon.engine.grammar import Grammars
from ipc.records import Guide, GuideKind, ToolCallFormat, ToolFunction
from proxy.tool_calls import ToolGrammarError, ToolUse
from tests.daemon.engine.test_grammar import TOK, _object, _schemas, generate
from tests.proxy.tool_calls.test_parsers import merged, parse


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(TOK, TOK.special_token_ids)


def tool(name: str, schema: dict[str, Any] | None) -> ToolFunction:
    return ToolFunction(name, parameters=None if schema is None else json.dumps(schema))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(schemas=st.lists(_object(_schemas), min_size=1, max_size=3),
       fmt=st.sampled_from(list(ToolCallFormat)), parallel=st.booleans(),
       named=st.booleans(), max_tokens=st.integers(40, 240), seed=st.integers(0, 2**31))
def test_forced_calls_always_validate(grammars: Grammars, schemas: list[dict[str, Any]],
                                      fmt: ToolCallFormat, parallel: bool, named: bool,
                                      max_tokens: int, seed: int) -> None:
    tools = tuple(tool(f"f{i}", s) for i, s in enumerate(schemas))
    forced = tools[-1:] if named else tools
    use = ToolUse(tools, "required", forced, parallel)
    guide = use.guide(fmt, None)
    assert guide is not None and guide.source == "tools"
    if not Constraint(grammars, grammars.compile(guide).result()).feasible(max_tokens):
        return  # refused at admission with a 400 naming max_tokens
    text, ended = generate(grammars, guide, max_tokens, seed)
    assert ended, f"ran out of its {max_tokens} tokens: {text!r}"
    content, calls = merged(parse(fmt, [text], tuple(t.name for t in forced), parallel))
    assert content == "" and calls, text
    assert len(calls) == 1 or parallel
    by_name = {t.name: s for t, s in zip(tools, schemas, strict=True)}
    for _, name, arguments in calls:
        jsonschema.validate(json.loads(arguments), by_name[name])


def _forced_arguments(grammars: Grammars, schema: dict[str, Any] | None,
                      seeds: range) -> list[Any]:
    """The arguments of a forced call of a function of `schema`, sampled from random logits."""
    fn = tool("f", schema)
    guide = ToolUse((fn,), "required", (fn,), parallel=False).guide(ToolCallFormat.HERMES, None)
    assert guide is not None
    out = []
    for seed in seeds:
        text, ended = generate(grammars, guide, 80, seed)
        _, calls = merged(parse(ToolCallFormat.HERMES, [text], ("f",)))
        assert ended and len(calls) == 1, text
        out.append(json.loads(calls[0][2]))
    return out


def test_a_function_of_no_parameters_is_called_with_none(grammars: Grammars) -> None:
    """As OpenAI reads them, and as the `llm` CLI's zero-argument tools send them: a weak model
    fills an open object with junk keys, which the function cannot take."""
    for schema in (None, {"type": "object", "properties": {}}, {"type": "object"}):
        assert _forced_arguments(grammars, schema, range(24)) == [{}] * 24, schema


def test_arguments_hold_only_the_properties_listed(grammars: Grammars) -> None:
    point = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"at": point, "tags": {
        "type": "array", "items": point, "maxItems": 2}}}
    for arguments in _forced_arguments(grammars, schema, range(24)):
        assert set(arguments) <= {"at", "tags"}, arguments
        for inner in [arguments.get("at", {}), *arguments.get("tags", [])]:
            assert set(inner) <= {"x", "y"}, arguments
    free = {"type": "object", "properties": {"meta": {"type": "object",
                                                      "additionalProperties": True}}}
    extra = [a for a in _forced_arguments(grammars, free, range(24)) if a.get("meta")]
    assert extra  # what a schema says of other properties stands


def test_auto_with_a_response_format_is_calls_or_that_content(grammars: Grammars) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    content = Guide(GuideKind.JSON_SCHEMA, json.dumps(schema), "response_format")
    tools = (tool("get", {"type": "object", "properties": {"q": {"type": "string",
                                                                   "maxLength": 5}}}),)
    guide = ToolUse(tools, "auto").guide(ToolCallFormat.HERMES, content)
    assert guide is not None and guide.kind is GuideKind.GRAMMAR
    kinds = set()
    for seed in range(12):
        text, ended = generate(grammars, guide, 80, seed)
        answer, calls = merged(parse(ToolCallFormat.HERMES, [text], ("get",)))
        assert ended
        if calls:
            assert answer == "" and calls[0][1] == "get"
        else:
            jsonschema.validate(json.loads(answer), schema)
        kinds.add(bool(calls))
    assert kinds == {True, False}  # both branches are reachable at random


def test_none_and_plain_auto_need_no_grammar() -> None:
    tools = (tool("get", None),)
    content = Guide(GuideKind.JSON_OBJECT, source="response_format")
    assert ToolUse(tools, "auto").guide(ToolCallFormat.HERMES, None) is None
    assert ToolUse(tools, "none").guide(ToolCallFormat.HERMES, content) is content
    with pytest.raises(ToolGrammarError, match="grammar output"):
        ToolUse(tools, "auto").guide(ToolCallFormat.HERMES,
                                     Guide(GuideKind.GRAMMAR, 'start: "x"'))
