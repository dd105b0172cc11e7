"""Mistral's tool calls, both forms: ``[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]``
(Mistral 7B v0.3, Nemo: the form tether's grammar writes) and ``[TOOL_CALLS]name[ARGS]{...}``,
optionally with ``[CALL_ID]id`` before ``[ARGS]``, once per call (Mistral Small 3.2, Devstral,
Ministral 3). The markers are special tokens that the daemon decodes as text for this format."""

from __future__ import annotations

import enum

from proxy.tool_calls.grammar import CallSyntax
from proxy.tool_calls.parser import Event, FormatParser, find_marker

START = "[TOOL_CALLS]"
_ARGS = "[ARGS]"
_CALL_ID = "[CALL_ID]"

SYNTAX = CallSyntax(head='{"name": ', arguments_key="arguments", tail="}", separator=", ",
                    prefix=START + "[", suffix="]")

_WS = " \t\r\n"


class _At(enum.Enum):
    TEXT = enum.auto()  # content, or between calls: up to the next marker
    MARKER = enum.auto()  # after [TOOL_CALLS]: a list or a name follows
    LIST = enum.auto()  # in the list, between its calls
    NAME = enum.auto()  # a name, up to [ARGS] or [CALL_ID]
    CALL_ID = enum.auto()  # the id the model wrote, up to [ARGS]


class MistralParser(FormatParser):
    _at = _At.TEXT
    _head = ""  # what was read since the marker that no open call holds yet
    _name = ""

    def _outside(self, text: str) -> str:
        if self._at is _At.TEXT:
            return self._in_text(text)
        if self._at is _At.MARKER or self._at is _At.LIST:
            return self._in_list(text)
        return self._in_name(text)

    def _in_text(self, text: str) -> str:
        before, marker, after = find_marker(self._held + text, (START,))
        self._held = "" if marker else after
        self._text(before)
        if marker is None:
            return ""
        self._at, self._head = _At.MARKER, marker
        return after

    def _in_list(self, text: str) -> str:
        kept = text.lstrip(_WS + ("," if self._at is _At.LIST else ""))
        self._head += text[:len(text) - len(kept)]
        if not kept:
            return ""
        char = kept[0]
        if self._at is _At.MARKER and char != "[":
            self._at, self._name = _At.NAME, ""
            return kept
        if self._at is _At.MARKER:
            self._at, self._head = _At.LIST, self._head + char
            return kept[1:]
        if char == "{" and not self._closed:
            head, self._head = self._head, ""
            self._open(head)
            return kept
        self._at = _At.TEXT  # the list ended (or broke off)
        self._text(self._head)
        self._head = ""
        return kept[1:] if char == "]" else kept

    def _in_name(self, text: str) -> str:
        markers = (_ARGS,) if self._at is _At.CALL_ID else (_ARGS, _CALL_ID)
        before, marker, after = find_marker(self._held + text, markers)
        self._held = "" if marker else after
        if self._at is _At.NAME:
            self._name += before
        self._head += before + (marker or "")
        if marker is None:
            return ""
        if marker == _CALL_ID:
            self._at = _At.CALL_ID
            return after
        head, self._head = self._head, ""
        self._at = _At.TEXT
        if self._closed:
            return ""
        self._open(head, name=self._name.strip())
        return after

    def end(self) -> list[Event]:
        if self._call is None and self._at is not _At.TEXT:  # cut off before a call began
            self._text(self._head)
            self._at, self._head = _At.TEXT, ""
        return super().end()
