"""What each request field does: honoured, accepted as a no-op, or refused.

Every field of OpenAI's completions, chat and Responses bodies (and the vLLM extensions kept
here) is declared on the msgspec type its route decodes with, and a field no type declares is a
400 naming it (``forbid_unknown_fields``), as OpenAI answers. A declared field is honoured unless
its annotation carries one of two marks (`honoured` adds what the client should know of how):

- `no_op`: accepted and not acted on, because acting on it could not change what the client
  gets (an end-user id, a latency hint, a cache key: the prefix cache needs none);
- `refused`: declared so that its 400 says "not supported" rather than "unknown"; accepted only
  with one of the values that ask for nothing (``tools: []``, ``include: []``).

`decode_body` checks the marks of every type it decodes; `table` reads them back for
docs/api.md (proxy/field_table.py) and the OpenAPI document carries them as
``x-tether``, so the docs, the document and the validation cannot drift apart.
"""

from __future__ import annotations

import functools
import typing
from typing import Any, NamedTuple

import msgspec

from proxy.http.errors import ApiError

NO_OP = "no-op"
REFUSED = "refused"
HONOURED = "honoured"

# Why the common no-ops change nothing.
CACHE_HINT = "the prefix cache is automatic and keyed by the prompt's tokens"
LATENCY_HINT = "a latency hint: the answer is the same"
END_USER = "an end-user id for the provider's abuse monitoring"
# vLLM's `priority`, which routers (smg) send as 0 on every request.
NO_PRIORITY = "requests are served fairly in arrival order, with no priorities"


def honoured(why: str) -> msgspec.Meta:
    """The mark of a field honoured, with what is worth knowing of how (a limit, a reading)."""
    return msgspec.Meta(extra={"tether": HONOURED, "why": why},
                        extra_json_schema={"x-tether": HONOURED, "x-tether-why": why})


def no_op(why: str, example: Any) -> msgspec.Meta:
    """The mark of a field accepted and not acted on; `example` is a value a client sends."""
    return msgspec.Meta(examples=[example], extra={"tether": NO_OP, "why": why},
                        extra_json_schema={"x-tether": NO_OP, "x-tether-why": why})


def refused(why: str, example: Any, allowed: tuple[Any, ...] = ()) -> msgspec.Meta:
    """The mark of a field refused (400) unless omitted, null or one of `allowed`; `example` is
    a value that is refused."""
    return msgspec.Meta(examples=[example], extra={"tether": REFUSED, "why": why,
                                                   "allowed": allowed},
                        extra_json_schema={"x-tether": REFUSED, "x-tether-why": why})


class Row(NamedTuple):
    name: str
    status: str  # HONOURED, NO_OP or REFUSED
    why: str
    example: Any  # a value showing the mark (none for honoured fields)
    allowed: tuple[Any, ...]


@functools.cache
def table(struct_type: type[msgspec.Struct]) -> tuple[Row, ...]:
    """The fields of a request type, each with its mark, in declaration order."""
    hints = typing.get_type_hints(struct_type, include_extras=True)
    rows = []
    for field in msgspec.structs.fields(struct_type):
        mark = _mark(hints[field.name])
        if mark is None:
            rows.append(Row(field.encode_name, HONOURED, "", None, ()))
        else:
            extra, example = mark
            rows.append(Row(field.encode_name, extra["tether"], extra["why"], example,
                            tuple(extra.get("allowed", ()))))
    return tuple(rows)


def _mark(hint: Any) -> tuple[dict[str, Any], Any] | None:
    for meta in getattr(hint, "__metadata__", ()):
        if isinstance(meta, msgspec.Meta) and meta.extra and "tether" in meta.extra:
            return meta.extra, (meta.examples or [None])[0]
    return None


@functools.cache
def _refused(struct_type: type[msgspec.Struct]) -> tuple[Row, ...]:
    return tuple(row for row in table(struct_type) if row.status == REFUSED)


def check_refused(request: msgspec.Struct) -> None:
    """ApiError(400) naming the first refused field the request sets to more than nothing."""
    for row in _refused(type(request)):
        value = getattr(request, row.name)
        if value is not None and value not in row.allowed:
            raise ApiError(400, f"'{row.name}' is not supported by this server: {row.why}",
                           param=row.name, code="unsupported_parameter")
