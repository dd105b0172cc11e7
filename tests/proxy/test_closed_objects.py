"""Objects that take only the properties they list (OpenAI's strict mode): every object schema
that says nothing of other properties is closed, wherever it sits; an object that is only part
of its instance's schema is left open, so that closing never forbids what another part lists;
and a closed schema never allows what the original did not."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from proxy.closed_objects import SchemaTooDeep, close_objects

CLOSED = {"additionalProperties": False}
POINT = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}


def test_every_object_that_says_nothing_of_others_is_closed() -> None:
    assert close_objects({"type": "object", "properties": {}}) == {
        "type": "object", "properties": {}, **CLOSED}
    assert close_objects({"type": "object"}) == {"type": "object", **CLOSED}
    assert close_objects({"properties": {"a": {}}}) == {"properties": {"a": {}}, **CLOSED}
    assert close_objects({"type": ["object", "null"]})["additionalProperties"] is False
    nested = close_objects({
        "type": "object", "properties": {
            "point": POINT, "points": {"type": "array", "items": POINT},
            "pair": {"type": "array", "prefixItems": [POINT, POINT]},
            "maybe": {"anyOf": [POINT, {"type": "null"}]},  # pydantic's Optional[Model]
            "ref": {"$ref": "#/$defs/Point"}},
        "$defs": {"Point": POINT}})
    props = nested["properties"]
    for closed in (nested, props["point"], props["points"]["items"],
                   *props["pair"]["prefixItems"], props["maybe"]["anyOf"][0],
                   nested["$defs"]["Point"]):
        assert closed["additionalProperties"] is False, closed
    assert props["ref"] == {"$ref": "#/$defs/Point"}  # closed where it is defined


def test_what_a_schema_says_of_other_properties_stands() -> None:
    for said in ({"additionalProperties": True}, {"additionalProperties": {"type": "string"}},
                 {"patternProperties": {"^x_": {}}}, {"unevaluatedProperties": False}):
        schema = {"type": "object", "properties": {"a": {}}, **said}
        assert close_objects(schema) == schema
    # A map's values are schemas and closed too.
    free = close_objects({"type": "object", "additionalProperties": POINT})
    assert free["additionalProperties"] == {**POINT, **CLOSED}


def test_an_object_that_is_part_of_its_instances_schema_stays_open() -> None:
    named = {"properties": {"name": {"type": "string"}}, "required": ["name"]}
    both = {"allOf": [{"$ref": "#/$defs/Point"}, named], "$defs": {"Point": POINT}}
    closed = close_objects(both)
    assert closed == both
    jsonschema.validate({"x": 1, "name": "a"}, closed)  # what allOf joins is still allowed
    beside = {"type": "object", "properties": {"x": {}}, "anyOf": [named, {"required": ["x"]}]}
    assert close_objects(beside) == beside
    # Members that only say what is required list nothing: the object is closed.
    required = {"type": "object", "properties": {"a": {}, "b": {}},
                "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}
    assert close_objects(required) == {**required, **CLOSED}
    # A definition that allOf does not use is closed.
    unused = close_objects({**both, "$defs": {"Point": POINT, "Other": POINT}})
    assert unused["$defs"] == {"Point": POINT, "Other": {**POINT, **CLOSED}}


def test_values_and_negations_are_never_read_as_schemas() -> None:
    schema = {"type": "object", "properties": {
        "mode": {"enum": [{"type": "object"}]}, "fixed": {"const": {"properties": {}}},
        "other": {"not": {"type": "object"}}, "properties": {"type": "object"}},
        "default": {"type": "object"}}
    closed = close_objects(schema)
    props = closed["properties"]
    assert props["mode"] == {"enum": [{"type": "object"}]}
    assert props["fixed"] == {"const": {"properties": {}}}
    assert props["other"] == {"not": {"type": "object"}}
    assert props["properties"] == {"type": "object", **CLOSED}  # a property named so
    assert closed["default"] == {"type": "object"}


@pytest.mark.parametrize("instance", [{}, {"a": 1}, {"a": 1, "z": 2}, {"b": {"c": []}},
                                      {"b": {"c": [], "d": 1}}, {"b": None}, [], "s"])
def test_a_closed_schema_allows_only_what_the_original_allows(instance: Any) -> None:
    schema = {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"anyOf": [{"type": "object", "properties": {
            "c": {"type": "array"}}}, {"type": "null"}]}}}
    closed = close_objects(schema)
    valid = jsonschema.Draft202012Validator(closed).is_valid(instance)
    if valid:
        jsonschema.validate(instance, schema)
    keys = set(instance) if isinstance(instance, dict) else set()
    inner = instance.get("b") if isinstance(instance, dict) else None
    unlisted = keys - {"a", "b"} or (set(inner) - {"c"} if isinstance(inner, dict) else set())
    assert valid == (isinstance(instance, dict) and not unlisted and jsonschema.Draft202012Validator(
        schema).is_valid(instance))


def test_a_schema_too_deep_to_walk_is_said_so() -> None:
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(SchemaTooDeep):
        close_objects(deep)
    assert json.dumps(close_objects(POINT))  # and the walk still works after
