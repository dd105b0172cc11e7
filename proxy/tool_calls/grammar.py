"""The grammar that forces tool calls (``tool_choice`` required or a named function): the calls in
the model's own format, each call's arguments matching its function's parameters, whose objects
take only the properties they list (proxy/closed_objects.py: a function of no parameters takes
``{}``).

It is Lark with llguidance's ``%json`` extension (daemon/engine/grammar.py compiles it like any
other Guide), so the arguments always validate, and the daemon's budget closes the calls before
``max_tokens``. The JSON is written as chat templates write it (``", "`` and ``": "``, nothing
else: whitespace is not the model's to choose). With ``tool_choice`` auto and a response format,
the output is the calls or the content the format asks for.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from ipc.records import Guide, GuideKind, ToolFunction
from proxy.closed_objects import SchemaTooDeep, close_objects
from proxy.guides import MAX_GUIDE_BYTES

# As json.dumps and Jinja's tojson write JSON: what the model saw in its prompt.
_TOOL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# As structured outputs write it (daemon/engine/grammar.py): compact.
_CONTENT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@dataclass(frozen=True, slots=True)
class CallSyntax:
    """How a format writes calls: `prefix`, then each call as `head`, the name as a JSON
    string, ``, "<arguments_key>": `` and the arguments, then `tail`; `separator` between
    calls, `suffix` after the last."""

    head: str
    arguments_key: str
    tail: str
    separator: str
    prefix: str = ""
    suffix: str = ""


class ToolGrammarError(ValueError):
    """What the request asks cannot be a grammar; the message says why."""


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json_rule(schema: Any, options: dict[str, Any]) -> str:
    if not isinstance(schema, dict):
        raise ToolGrammarError("a JSON schema must be an object")
    try:
        return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)
    except RecursionError:
        raise ToolGrammarError("a JSON schema is nested too deeply") from None


def _calls_rules(syntax: CallSyntax, tools: Sequence[ToolFunction], parallel: bool) -> list[str]:
    # The grammar is a guide like any other, bounded as one: checked before any of it is built.
    size = sum(len(t.parameters.encode()) for t in tools if t.parameters)
    if size > MAX_GUIDE_BYTES:
        raise ToolGrammarError(
            f"the parameters of the {len(tools)} functions a call may be to are {size} bytes, "
            f"more than the server's limit of {MAX_GUIDE_BYTES} for one grammar; name one "
            "function in 'tool_choice', or offer fewer")
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    repeat = f" ({_literal(syntax.separator)} call)*" if parallel else ""
    around = [_literal(s) for s in (syntax.prefix, syntax.suffix)]
    rules = [f"calls: {around[0] if syntax.prefix else ''} call{repeat} "
             f"{around[1] if syntax.suffix else ''}".rstrip(),
             f"call: {calls}"]
    for i, tool in enumerate(tools):
        head = f'{syntax.head}{_literal(tool.name)}, {_literal(syntax.arguments_key)}: '
        rules.append(f"call_{i}: {_literal(head)} args_{i} {_literal(syntax.tail)}")
        rules.append(f"args_{i}: {_json_rule(_arguments_schema(tool), _TOOL_JSON)}")
    return rules


def _arguments_schema(tool: ToolFunction) -> Any:
    """The schema a call's arguments follow: the function's parameters, objects closed."""
    try:
        schema = msgspec.json.decode(tool.parameters) if tool.parameters else {"type": "object"}
        return close_objects(schema) if isinstance(schema, dict) else schema
    except (RecursionError, SchemaTooDeep):
        raise ToolGrammarError(f"the parameters of '{tool.name}' are nested too deeply") from None


def calls_grammar(syntax: CallSyntax, tools: Sequence[ToolFunction], parallel: bool) -> str:
    """Lark for one call of one of `tools` (or several, with `parallel`)."""
    return "\n".join(["start: calls", *_calls_rules(syntax, tools, parallel)])


def calls_or_content(syntax: CallSyntax, tools: Sequence[ToolFunction], parallel: bool,
                     content: Guide) -> str:
    """Lark for the calls, or the content `content` constrains."""
    return "\n".join(["start: calls | content", f"content: {_content_rule(content)}",
                      *_calls_rules(syntax, tools, parallel)])


def _content_rule(guide: Guide) -> str:
    if guide.kind is GuideKind.JSON_SCHEMA:
        return _json_rule(json.loads(guide.spec), _CONTENT_JSON)
    if guide.kind is GuideKind.JSON_OBJECT:
        return _json_rule({"type": "object"}, _CONTENT_JSON)
    if guide.kind is GuideKind.REGEX:
        return "/" + guide.spec.replace("/", "\\/") + "/"
    if guide.kind is GuideKind.CHOICE:
        return " | ".join(_literal(choice) for choice in json.loads(guide.spec))
    raise ToolGrammarError(f"a {guide.kind.value} output cannot be combined with tool calls")
