"""Tool calls in chat completions' answers, as OpenAI writes them.

Each choice's text goes through its format's parser as it arrives (proxy/tool_calls/). A stream
says each call's index, id, type and name once, in the first piece of that call, then only its
index and its arguments' next piece: ``{"index": 0, "function": {"arguments": "{\\"ci"}}``. A
collected message holds the content (null when there is none) and ``tool_calls``; a choice that
called tools and stopped ends with ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

from typing import Any

from ipc.records import Delta, Finish, ToolCallFormat
from proxy.openai.chunks import StreamChunks
from proxy.tool_calls import ToolUse, call_ids
from proxy.tool_calls.parser import CallArguments, CallStart, Content, Event, FormatParser


class ChatToolCalls:
    """One request's choices, each parsed for calls."""

    __slots__ = ("_called", "_fmt", "_parsers", "_use")

    def __init__(self, use: ToolUse, fmt: ToolCallFormat) -> None:
        self._use = use
        self._fmt = fmt
        self._parsers: dict[int, FormatParser] = {}
        self._called: set[int] = set()  # choices that made a call

    def _parser(self, index: int) -> FormatParser:
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._use.parser(self._fmt, call_ids(self._fmt))
            assert parser is not None, "only a request whose output may hold calls is parsed"
            self._parsers[index] = parser
        return parser

    def delta(self, index: int, text: str) -> dict[str, Any]:
        """What `text` adds to choice `index`'s delta: content, tool_calls, or nothing yet."""
        return self._fields(index, self._parser(index).feed(text))

    def end(self, index: int) -> dict[str, Any]:
        """What choice `index` still held when it ended."""
        parser = self._parsers.pop(index, None)
        return {} if parser is None else self._fields(index, parser.end())

    def event(self, chunks: StreamChunks, record: Delta | Finish, reason: str | None,
              token_ids: bool) -> bytes:
        """The stream event of `record` (`reason`: a Finish's finish_reason); none for a Delta
        that adds nothing the client would see yet (text the parser holds)."""
        index = record.index
        first = not chunks.started(index)
        if isinstance(record, Delta):
            fields = self.delta(index, record.text)
            if not (fields or first or record.logprobs or token_ids):
                return b""
            return chunks.event(record, chunk_choice(index, fields, None, first))
        assert reason is not None
        fields = self.end(index)
        return chunks.event(record, chunk_choice(index, fields, self.finish_reason(index, reason),
                                                 first))

    def finish_reason(self, index: int, reason: str) -> str:
        return "tool_calls" if reason == "stop" and index in self._called else reason

    def message(self, index: int, text: str) -> dict[str, Any]:
        """A collected choice's message: its whole text parsed at once (the same events as a
        stream of it, however it was cut)."""
        fields = self.delta(index, text)
        for key, value in self.end(index).items():
            if key == "content":
                fields["content"] = fields.get("content", "") + value
            else:
                fields.setdefault("tool_calls", []).extend(value)
        message: dict[str, Any] = {"role": "assistant", "content": fields.get("content")}
        calls = _joined(fields.get("tool_calls", []))
        if calls:
            message["tool_calls"] = calls
        return message

    def _fields(self, index: int, events: list[Event]) -> dict[str, Any]:
        content: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        for event in events:
            if isinstance(event, Content):
                content.append(event.text)
            elif isinstance(event, CallStart):
                self._called.add(index)
                calls[event.index] = {"index": event.index, "id": event.call_id,
                                      "type": "function",
                                      "function": {"name": event.name, "arguments": ""}}
            elif isinstance(event, CallArguments):
                call = calls.setdefault(event.index, {"index": event.index,
                                                      "function": {"arguments": ""}})
                call["function"]["arguments"] += event.text
        fields: dict[str, Any] = {}
        if content:
            fields["content"] = "".join(content)
        if calls:
            fields["tool_calls"] = list(calls.values())
        return fields


def _joined(pieces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stream pieces of calls as whole calls: id, type, name and all the arguments."""
    calls: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        call = calls.get(piece["index"])
        if call is None:
            calls[piece["index"]] = {"id": piece["id"], "type": "function",
                                     "function": dict(piece["function"])}
        else:
            call["function"]["arguments"] += piece["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def chunk_choice(index: int, fields: dict[str, Any], finish: str | None,
                 first: bool) -> dict[str, Any]:
    """A streamed choice whose delta carries `fields`; the first says the role, and its content
    null while there is none yet, as OpenAI's first delta of a tool-call turn does: a client
    that adds the deltas up (the openai client's stream helper) then ends with the collected
    message's null content, not "" (text that follows replaces the null)."""
    delta: dict[str, Any] = {"role": "assistant", "content": None} if first else {}
    delta.update(fields)
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
