"""JSON schemas whose objects take only the properties they list, as OpenAI's strict mode and
xgrammar's default read them: applied to every tool call's arguments and to a ``strict``
json_schema response format before the grammar is built.

JSON Schema lets an object hold any property it does not list unless it says
``additionalProperties``; a grammar that allows that lets a weak model fill an object with keys
nobody asked for (``{"e>ف…": 0}`` for a function of no arguments). llguidance has no option to
read schemas otherwise, so the schema is rewritten: each object schema that says nothing of
other properties (no ``additionalProperties``, ``patternProperties`` or
``unevaluatedProperties``) gets ``"additionalProperties": false``.

An object is left open where it is only part of its instance's schema and another part may
list properties of its own, since closing one part would forbid what the others list: beside
``$ref``, or beside ``allOf``, ``anyOf``, ``oneOf``, ``if``/``then``/``else`` members that list
properties (members that only say ``required`` do not count), and as such a member itself, or a
definition an ``allOf`` member refers to. Under ``not`` nothing is changed (closing there would
widen what is allowed). ``enum``, ``const`` and annotations are values, never read as schemas.
"""

from __future__ import annotations

import enum
from typing import Any


class _Holds(enum.Enum):
    """What a keyword's value is."""

    SCHEMAS = enum.auto()  # a schema, or a list of schemas, each the whole of its instance's
    MAP = enum.auto()  # names to schemas
    PARTS = enum.auto()  # schemas of the same instance as their parent's
    # Alternatives, but parts beside an object's own keywords (they intersect with it).
    EITHER = enum.auto()


_KEYWORDS = {
    **dict.fromkeys(("items", "prefixItems", "additionalProperties", "contains", "propertyNames",
                     "unevaluatedItems", "unevaluatedProperties", "additionalItems"),
                    _Holds.SCHEMAS),
    **dict.fromkeys(("properties", "patternProperties", "$defs", "definitions",
                     "dependentSchemas"), _Holds.MAP),
    **dict.fromkeys(("allOf", "if", "then", "else"), _Holds.PARTS),
    **dict.fromkeys(("anyOf", "oneOf"), _Holds.EITHER),
}
_OTHERS_SAID = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# What makes a part of an instance's schema list properties of its own.
_LISTING = ("properties", "patternProperties", "additionalProperties", "$ref", "allOf", "anyOf",
            "oneOf", "if", "then", "else")


class SchemaTooDeep(ValueError):
    """The schema is nested deeper than the interpreter can walk."""


def close_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` whose objects take only the properties they list (see the module);
    SchemaTooDeep for a schema nested beyond the interpreter's recursion limit."""
    try:
        return _Closer(_parts_refs(schema)).walk(schema, whole=True)
    except RecursionError:
        raise SchemaTooDeep("the schema is nested too deeply") from None


def _is_object(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    if isinstance(kind, list):
        return "object" in kind
    return kind == "object" or (kind is None and "properties" in node)


def _parts_refs(schema: dict[str, Any]) -> frozenset[str]:
    """The definitions an ``allOf`` member refers to: parts of an instance's schema too."""
    found: set[str] = set()
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            holds = _KEYWORDS.get(key)
            if holds is None:
                continue
            if holds is _Holds.MAP:
                stack += value.values() if isinstance(value, dict) else ()
            elif isinstance(value, list):
                stack += value
                if key == "allOf":
                    found.update(m["$ref"] for m in value
                                 if isinstance(m, dict) and isinstance(m.get("$ref"), str))
            else:
                stack.append(value)
    return frozenset(found)


def _parts(node: dict[str, Any]) -> list[Any]:
    """The schemas `node` is intersected with (anyOf and oneOf are, beside an object's own
    keywords)."""
    parts = [node.get(k) for k in ("if", "then", "else")]
    for key in ("allOf", "anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            parts += node[key]
    return parts


def _lists(part: Any) -> bool:
    return isinstance(part, dict) and any(k in part for k in _LISTING)


class _Closer:
    __slots__ = ("_parts",)

    def __init__(self, parts: frozenset[str]) -> None:
        self._parts = parts

    def walk(self, node: Any, whole: bool) -> Any:
        """`node` with its objects closed; `whole`: it is the whole schema of its instance."""
        if not isinstance(node, dict):
            return node
        out = dict(node)
        is_object = _is_object(node)
        if whole and is_object and not any(k in node for k in _OTHERS_SAID) and not (
                "$ref" in node or any(_lists(part) for part in _parts(node))):
            out["additionalProperties"] = False
        for key, value in node.items():
            holds = _KEYWORDS.get(key)
            if holds is None:
                continue
            if holds is _Holds.MAP:
                if isinstance(value, dict):
                    out[key] = {name: self.walk(v, whole=not self._is_part(key, name))
                                for name, v in value.items()}
                continue
            each = holds is _Holds.SCHEMAS or (holds is _Holds.EITHER and not is_object)
            out[key] = ([self.walk(v, each) for v in value] if isinstance(value, list)
                        else self.walk(value, each))
        return out

    def _is_part(self, key: str, name: str) -> bool:
        return key in ("$defs", "definitions") and f"#/{key}/{name}" in self._parts
