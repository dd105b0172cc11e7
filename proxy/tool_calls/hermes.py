"""Hermes' tool calls, as Qwen 2.5 and 3, QwQ, Hermes 2 Pro and 3 write them (and tether's own
template teaches): content, then each call as ``<tool_call>\\n{"name": ..., "arguments": ...}
\\n</tool_call>``, one after another."""

from __future__ import annotations

from proxy.tool_calls.grammar import CallSyntax
from proxy.tool_calls.parser import FormatParser, find_marker

START = "<tool_call>"

SYNTAX = CallSyntax(head=START + '\n{"name": ', arguments_key="arguments",
                    tail="}\n</tool_call>", separator="\n")


class HermesParser(FormatParser):
    def _outside(self, text: str) -> str:
        # Up to the next call (a call's end tag is text outside calls, and dropped).
        before, marker, after = find_marker(self._held + text, (START,))
        self._held = "" if marker else after
        self._text(before)
        if marker is None:
            return ""
        self._open(marker)
        return after
