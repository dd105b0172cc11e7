"""Llama 3.1 to 3.3's JSON tool calls: an answer that is a call is ``{"name": ...,
"parameters": ...}`` and nothing else (several are joined with ``; ``, as vLLM reads them); any
other answer is content. A JSON answer that names no offered function is content too (a
`response_format` answer, say)."""

from __future__ import annotations

from proxy.tool_calls.grammar import CallSyntax
from proxy.tool_calls.parser import FormatParser, OpenCall

SYNTAX = CallSyntax(head='{"name": ', arguments_key="parameters", tail="}", separator="; ")

_WS = " \t\r\n"


class Llama3JsonParser(FormatParser):
    _content = False  # the answer turned out to be content, not calls

    def _outside(self, text: str) -> str:
        if self._content:
            self._text(text)
            return ""
        kept = text.lstrip(_WS + ";" if self.num_calls else _WS)
        if not self.num_calls:
            self._held += text[:len(text) - len(kept)]  # until the answer says what it is
        if not kept or (self.num_calls and (kept[0] != "{" or self._closed)):
            return ""  # text after the calls is not content
        lead, self._held = self._held, ""
        if kept[0] == "{":
            self._open(lead)
            return kept
        self._content = True
        return lead + kept

    def _give_back(self, call: OpenCall, rest: str) -> None:
        self._content = not self.num_calls
        super()._give_back(call, rest)
