"""Structured outputs: the request fields that constrain an output, as the Guide the daemon
compiles (`ipc.records.Guide`; daemon/engine/grammar.py).

Chat and completions take OpenAI's `response_format`, vLLM's `structured_outputs` and its older
`guided_*` names; the Responses API takes `text.format`. A request names at most one guide
(two are a 400 naming both). The proxy checks what is cheap to check — a schema is a JSON
object, a choice a non-empty list of strings, every spec within MAX_GUIDE_BYTES — and leaves
what a schema means to the daemon's compile, whose 400 names the field the guide came from
(`Guide.source`). Options that would change nothing are accepted; those that cannot be honoured
are refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from ipc.records import Guide, GuideKind
from proxy.closed_objects import SchemaTooDeep, close_objects
from proxy.fields import honoured, no_op, refused
from proxy.http.errors import ApiError

# A spec (a schema as JSON, a regex, a grammar, the choices as JSON) beyond this is refused: real
# schemas take kilobytes. One this size may take seconds to compile (8,000 optional properties:
# 4 to 14 s here), so the daemon compiles large specs in a lane of their own, where they never
# hold up a small one (daemon/engine/grammar.py).
MAX_GUIDE_BYTES = 256 << 10
MAX_CHOICES = 1024

# What docs/api.md says of the format fields (proxy/fields.py's `honoured`).
FORMAT_NOTE = (
    "a `strict` json_schema's objects take only the properties they list unless they say "
    "`additionalProperties`; a schema not strict allows other properties wherever JSON Schema "
    "does (an object without `additionalProperties: false`)")

# OpenAI's rule for a format's name.
SchemaName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
# A JSON Schema: an object; what it means is for the daemon's compile to judge.
Schema = dict[str, Any]
Spec = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_GUIDE_BYTES)]
Choices = Annotated[list[Annotated[str, msgspec.Meta(max_length=MAX_GUIDE_BYTES)]],
                    msgspec.Meta(min_length=1, max_length=MAX_CHOICES)]


class JsonSchema(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """`response_format.json_schema` (chat, completions)."""

    name: SchemaName
    schema: Schema
    # Every schema is enforced; a strict one's objects take only the properties they list, as
    # OpenAI's strict mode reads a schema (proxy/closed_objects.py).
    strict: bool | None = None
    description: str | None = None


class TextFormat(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    """Free text: no guide."""


class JsonObjectFormat(msgspec.Struct, tag="json_object", tag_field="type",
                       forbid_unknown_fields=True):
    """Any JSON object."""


class JsonSchemaFormat(msgspec.Struct, tag="json_schema", tag_field="type",
                       forbid_unknown_fields=True):
    json_schema: JsonSchema


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class TextJsonSchemaFormat(msgspec.Struct, tag="json_schema", tag_field="type",
                           forbid_unknown_fields=True, omit_defaults=True):
    """`text.format` of the Responses API: the same fields, one level up."""

    name: SchemaName
    schema: Schema
    strict: bool | None = None
    description: str | None = None


TextFormats = TextFormat | JsonObjectFormat | TextJsonSchemaFormat


class TextConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The Responses API's `text`, echoed in the Response object."""

    format: TextFormats | None = None
    # A hint to reasoning models on how much to say; accepted and echoed, nothing to act on.
    verbosity: Literal["low", "medium", "high"] | None = None


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` object: one constraint and its options."""

    json: Schema | Spec | None = None
    regex: Spec | None = None
    choice: Choices | None = None
    grammar: Spec | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    # JSON is compact here whatever these say, and a guide never falls back to free text.
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class GuidedFields(msgspec.Struct, kw_only=True):
    """The guide fields of chat and completions requests."""

    response_format: Annotated[ResponseFormat | None, honoured(FORMAT_NOTE)] = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's names before `structured_outputs`.
    guided_json: Schema | Spec | None = None
    guided_regex: Spec | None = None
    guided_choice: Choices | None = None
    guided_grammar: Spec | None = None
    guided_whitespace_pattern: Annotated[Any, refused("JSON is always compact", r"\s*")] = None
    guided_decoding_backend: Annotated[str | None, no_op(
        "the grammar engine is the server's own: any backend named gets the same constraint",
        "xgrammar")] = None


def _refuse(param: str, why: str) -> ApiError:
    return ApiError(400, f"'{param}' {why}", param=param, code="unsupported_parameter")


def _schema_guide(schema: Schema | str, source: str) -> Guide:
    if isinstance(schema, str):
        try:
            decoded = msgspec.json.decode(schema)
        except msgspec.DecodeError as e:
            raise ApiError(400, f"'{source}' is not valid JSON: {e}", param=source,
                           code="invalid_value") from None
        if not isinstance(decoded, dict):
            raise ApiError(400, f"'{source}' must be a JSON schema object", param=source,
                           code="invalid_value")
        spec = schema
    else:
        spec = msgspec.json.encode(schema).decode()
    return _bounded(Guide(GuideKind.JSON_SCHEMA, spec, source))


def _strict(schema: Schema, strict: bool | None, source: str) -> Schema:
    """A format's schema as `strict` reads it."""
    if not strict:
        return schema
    try:
        return close_objects(schema)
    except SchemaTooDeep as e:
        raise ApiError(400, f"'{source}': {e}", param=source, code="invalid_value") from None


def strict_schema_guide(schema: Schema, source: str) -> Guide:
    """The guide of a schema read as a `strict` json_schema format reads it (`source` names the
    field in errors)."""
    return _schema_guide(_strict(schema, True, source), source)


def _bounded(guide: Guide) -> Guide:
    size = len(guide.spec.encode())
    if size > MAX_GUIDE_BYTES:
        raise ApiError(400, f"'{guide.source}' is {size} bytes, more than the server's limit "
                       f"of {MAX_GUIDE_BYTES}", param=guide.source, code="invalid_value")
    return guide


def _text_guide(kind: GuideKind, spec: str, source: str) -> Guide:
    return _bounded(Guide(kind, spec, source))


def _choice_guide(choices: list[str], source: str) -> Guide:
    return _bounded(Guide(GuideKind.CHOICE, msgspec.json.encode(choices).decode(), source))


def _format_guide(fmt: ResponseFormat | TextFormats | None, source: str) -> Guide | None:
    if isinstance(fmt, JsonObjectFormat):
        return Guide(GuideKind.JSON_OBJECT, source=source)
    if isinstance(fmt, JsonSchemaFormat):
        schema = fmt.json_schema
        return _schema_guide(_strict(schema.schema, schema.strict, source), source)
    if isinstance(fmt, TextJsonSchemaFormat):
        return _schema_guide(_strict(fmt.schema, fmt.strict, source), source)
    return None


def _structured(so: StructuredOutputs) -> list[Guide]:
    if so.structural_tag is not None:
        raise _refuse("structured_outputs.structural_tag", "is not supported")
    if so.whitespace_pattern is not None:
        raise _refuse("structured_outputs.whitespace_pattern",
                      "is not supported: JSON is always compact")
    if so.disable_additional_properties:
        raise _refuse("structured_outputs.disable_additional_properties",
                      "is not supported: say 'additionalProperties': false in the schema")
    at = "structured_outputs."
    guides = [] if so.json is None else [_schema_guide(so.json, at + "json")]
    if so.regex is not None:
        guides.append(_text_guide(GuideKind.REGEX, so.regex, at + "regex"))
    if so.choice is not None:
        guides.append(_choice_guide(so.choice, at + "choice"))
    if so.grammar is not None:
        guides.append(_text_guide(GuideKind.GRAMMAR, so.grammar, at + "grammar"))
    if so.json_object:
        guides.append(Guide(GuideKind.JSON_OBJECT, source=at + "json_object"))
    if not guides:
        raise ApiError(400, "'structured_outputs' names no constraint: give one of json, regex, "
                       "choice, grammar, json_object", param="structured_outputs",
                       code="invalid_value")
    return guides


def _legacy(req: GuidedFields) -> list[Guide]:
    guides = [] if req.guided_json is None else [_schema_guide(req.guided_json, "guided_json")]
    if req.guided_regex is not None:
        guides.append(_text_guide(GuideKind.REGEX, req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        guides.append(_choice_guide(req.guided_choice, "guided_choice"))
    if req.guided_grammar is not None:
        guides.append(_text_guide(GuideKind.GRAMMAR, req.guided_grammar, "guided_grammar"))
    return guides


def _one(guides: list[Guide]) -> Guide | None:
    if len(guides) > 1:
        first, second = guides[0].source, guides[1].source
        raise ApiError(400, f"'{first}' and '{second}' both constrain the output; send one of "
                       "them", param=second, code="invalid_value")
    return guides[0] if guides else None


def request_guide(req: GuidedFields) -> Guide | None:
    """The guide a chat or completions request asks for; None for free text."""
    guides = []
    fmt = _format_guide(req.response_format, "response_format")
    if fmt is not None:
        guides.append(fmt)
    if req.structured_outputs is not None:
        guides += _structured(req.structured_outputs)
    return _one(guides + _legacy(req))


def text_guide(text: TextConfig | None) -> Guide | None:
    """The guide a Responses request's `text.format` asks for; None for free text."""
    return None if text is None else _format_guide(text.format, "text.format")


def text_echo(text: TextConfig | None) -> dict[str, Any]:
    """The Response object's `text`: the format as the request gave it (text by default)."""
    given = {} if text is None else msgspec.to_builtins(text)
    return {"format": {"type": "text"}, **given}
