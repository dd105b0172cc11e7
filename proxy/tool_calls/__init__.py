"""Tool calls: the formats models write them in (one module each, chosen by the daemon from the
chat template, or by --tool-call-parser) and what a request asks of them (`ToolUse`).

A request's tools reach the chat template; `tool_choice` says what the output may be: ``none``
(text, not parsed), ``auto`` (the model's choice, parsed from its format), ``required`` or a
named function (forced by a grammar, parsed the same way). Every output that may hold calls is
parsed by its format's parser as it streams (proxy/tool_calls/parser.py).
"""

from __future__ import annotations

import hashlib
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ipc.records import Guide, GuideKind, ToolCallFormat, ToolFunction
from proxy.tool_calls import hermes, llama3_json, mistral
from proxy.tool_calls.grammar import (
    CallSyntax,
    ToolGrammarError,
    calls_grammar,
    calls_or_content,
)
from proxy.tool_calls.parser import FormatParser

__all__ = ["FORMATS", "ToolFormat", "ToolGrammarError", "ToolUse"]


@dataclass(frozen=True, slots=True)
class ToolFormat:
    parser: type[FormatParser]
    syntax: CallSyntax
    id_length: int | None = None  # Mistral's templates take ids of 9 letters and digits only


FORMATS = {
    ToolCallFormat.HERMES: ToolFormat(hermes.HermesParser, hermes.SYNTAX),
    ToolCallFormat.LLAMA3_JSON: ToolFormat(llama3_json.Llama3JsonParser, llama3_json.SYNTAX),
    ToolCallFormat.MISTRAL: ToolFormat(mistral.MistralParser, mistral.SYNTAX, id_length=9),
}

_ALNUM = string.ascii_letters + string.digits


def call_ids(fmt: ToolCallFormat, response_id: str | None = None) -> Callable[[int], str]:
    """The ids of an output's calls: random, or derived from the response's id (so that every
    GET of a stored response names its calls the same)."""
    length = FORMATS[fmt].id_length

    def make(index: int) -> str:
        if response_id is None:
            if length is None:
                return "call_" + secrets.token_hex(12)
            return "".join(secrets.choice(_ALNUM) for _ in range(length))
        if length is None:
            return f"call_{response_id.removeprefix('resp_')}_{index}"
        digest = hashlib.sha256(f"{response_id}/{index}".encode()).digest()
        return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:length])

    return make


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a request asks of tool calls, resolved: the functions offered, the choice
    (`forced`: the functions a call must be to; `parallel`: more than one call allowed;
    `custom`: the functions that stand for Responses custom tools, whose calls are their own
    items)."""

    tools: tuple[ToolFunction, ...]
    choice: Literal["none", "auto", "required"]
    forced: tuple[ToolFunction, ...] = ()
    parallel: bool = True
    custom: frozenset[str] = frozenset()

    @property
    def parsed(self) -> bool:
        """Whether the output may hold calls."""
        return self.choice != "none" and bool(self.tools)

    def guide(self, fmt: ToolCallFormat, content: Guide | None) -> Guide | None:
        """The output's constraint: forced calls, calls or the content `content` asks for, or
        `content` alone; ToolGrammarError when they cannot be combined."""
        syntax = FORMATS[fmt].syntax
        if self.forced:
            return Guide(GuideKind.GRAMMAR, calls_grammar(syntax, self.forced, self.parallel),
                         "tools")
        if content is None or not self.parsed:
            return content
        return Guide(GuideKind.GRAMMAR,
                     calls_or_content(syntax, self.tools, self.parallel, content), "tools")

    def parser(self, fmt: ToolCallFormat, make_id: Callable[[int], str]) -> FormatParser | None:
        if not self.parsed:
            return None
        names = frozenset(t.name for t in (self.forced or self.tools))
        return FORMATS[fmt].parser(names, make_id, self.parallel)
