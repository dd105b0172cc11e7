"""A Messages request's answer, from the daemon's records: the ``message`` object, or its stream
of events, which proxy/engine/exchange.py and proxy/engine/token_stream.py write as they write a chat
completion's (the `Answer` protocol).

    message_start, ping, then per content block content_block_start, content_block_delta
    (``text_delta`` or ``input_json_delta``) ..., content_block_stop; message_delta (the
    stop_reason and the usage), message_stop; or an ``error`` event where the request failed.

An output offered tools is parsed for calls by its format's parser (the chat path's,
proxy/tool_calls/): its text is a ``text`` block, each call a ``tool_use`` block, in the order
written. usage: ``input_tokens`` are the prompt's tokens the prefix cache did not hold,
``cache_read_input_tokens`` those it did (Anthropic counts the two apart), ``output_tokens`` the
generated ones.
"""

from __future__ import annotations

from typing import Any

import orjson

from ipc.records import Delta, Finish, FinishReason, ToolCallFormat, Usage
from proxy.anthropic.errors import error_event
from proxy.engine.batching import Batch
from proxy.engine.collected import CollectedBudget
from proxy.http.errors import ApiError
from proxy.http.sse import sse_event
from proxy.openai.completion_answer import finish_reason
from proxy.tool_calls import ToolUse, call_ids
from proxy.tool_calls.parser import CallArguments, CallStart, Content, Event, FormatParser

Block = dict[str, Any]
PING = sse_event({"type": "ping"}, "ping")
# A stream idle this long gets a ping (proxy/engine/token_stream.py's keepalive), as Anthropic's do.
PING_INTERVAL_S = 10.0


def usage_body(usage: Usage) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens}


def stop_reason(record: Finish, called: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence; a sequence the server gave up on raises the
    ApiError it is (proxy/openai/completion_answer.py's)."""
    finish_reason(record)
    if record.reason is FinishReason.LENGTH:
        return "max_tokens", None
    if record.stop is not None:
        return "stop_sequence", record.stop
    return ("tool_use" if called else "end_turn"), None


class MessageAnswer:
    """One message: its content blocks as they are written, streamed or collected."""

    __slots__ = ("_budget", "_content", "_ended", "_open", "_parser", "_started", "id", "model",
                 "ok", "stream")

    def __init__(self, rid: str, model: str, use: ToolUse | None, fmt: ToolCallFormat,
                 stream: bool, budget: CollectedBudget | None = None) -> None:
        self.id = rid
        self.model = model
        self.stream = stream
        self.ok = False  # the engine ended the message as it should
        self._budget = budget
        self._parser: FormatParser | None = (
            use.parser(fmt, call_ids(fmt)) if use is not None else None)
        self._content: list[Block] = []  # every block so far (a call's input as JSON text)
        self._open: Block | None = None  # the block being written
        self._started = False  # message_start sent
        # How it ended: stop_reason, stop_sequence and usage.
        self._ended: tuple[str, str | None, dict[str, int]] | None = None

    # --- the Answer protocol (proxy/engine/exchange.py) ------------------------------------------------

    def render(self, batch: Batch) -> tuple[bytes, bool]:
        events: list[bytes] = []
        try:
            for record in batch:
                if not self._started:
                    self._started = True
                    events += [self._message_start(record), PING]
                if isinstance(record, Delta):
                    events += self._delta(record.text)
                else:
                    events += self._finish(record)
        except ApiError as exc:
            # Headers are gone already: the error is the last event, after its batch's others.
            self.ok = False
            events.append(error_event(exc))
            return b"".join(events), True
        return b"".join(events), self.ok

    def error(self, exc: ApiError) -> bytes:
        return error_event(exc)

    def collect(self, batch: Batch) -> None:
        for record in batch:
            if isinstance(record, Delta):
                if self._budget is not None:
                    self._budget.add(record)
                self._delta(record.text)
            else:
                self._finish(record)

    def body(self) -> dict[str, Any]:
        return self._message

    # --- blocks ---------------------------------------------------------------------------------

    def _message_start(self, first: Delta | Finish) -> bytes:
        prompt = first.prompt_tokens if isinstance(first, Delta) else first.usage.prompt_tokens
        usage = usage_body(Usage(prompt, 0))
        return sse_event({"type": "message_start", "message": self._object([], None, None, usage)},
                         "message_start")

    def _delta(self, text: str) -> list[bytes]:
        if not text:
            return []
        if self._parser is None:
            return self._events([Content(text)])
        return self._events(self._parser.feed(text))

    def _events(self, parsed: list[Event]) -> list[bytes]:
        out: list[bytes] = []
        for event in parsed:
            if isinstance(event, Content):
                if self._open is None or self._open["type"] != "text":
                    out += self._start({"type": "text", "text": ""})
                if not self.stream:  # a stream's blocks keep no text
                    self._open["text"] += event.text  # type: ignore[index]
                out.append(self._block_delta({"type": "text_delta", "text": event.text}))
            elif isinstance(event, CallStart):
                out += self._start({"type": "tool_use", "id": event.call_id, "name": event.name,
                                    "input": ""})
            elif isinstance(event, CallArguments) and self._open is not None:
                if not self.stream:
                    self._open["input"] += event.text
                out.append(self._block_delta({"type": "input_json_delta",
                                              "partial_json": event.text}))
        return out

    def _start(self, block: Block) -> list[bytes]:
        out = self._stop()
        self._content.append(block)
        self._open = block
        if self.stream:
            shown = {**block, "input": {}} if block["type"] == "tool_use" else block
            out.append(sse_event({"type": "content_block_start", "index": len(self._content) - 1,
                                  "content_block": shown}, "content_block_start"))
        return out

    def _block_delta(self, delta: dict[str, str]) -> bytes:
        if not self.stream:
            return b""
        return sse_event({"type": "content_block_delta", "index": len(self._content) - 1,
                          "delta": delta}, "content_block_delta")

    def _stop(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        if not self.stream:
            return []
        return [sse_event({"type": "content_block_stop", "index": len(self._content) - 1},
                          "content_block_stop")]

    def _finish(self, record: Finish) -> list[bytes]:
        out = self._events(self._parser.end()) if self._parser is not None else []
        out += self._stop()
        called = any(block["type"] == "tool_use" for block in self._content)
        reason, sequence = stop_reason(record, called)
        self.ok = True
        self._ended = (reason, sequence, usage_body(record.usage))
        if not self.stream:
            return out
        usage = {k: v for k, v in self._ended[2].items() if k != "cache_creation_input_tokens"}
        out.append(sse_event({"type": "message_delta", "usage": usage, "delta": {
            "stop_reason": reason, "stop_sequence": sequence}}, "message_delta"))
        out.append(sse_event({"type": "message_stop"}, "message_stop"))
        return out

    @property
    def _message(self) -> dict[str, Any]:
        assert self._ended is not None, "a collected message is rendered once it has ended"
        content = [{**block, "input": _input(block["input"])} if block["type"] == "tool_use"
                   else block for block in self._content]
        return self._object(content, *self._ended)

    def _object(self, content: list[Block], reason: str | None, sequence: str | None,
                usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": usage}


def _input(arguments: str) -> Any:
    """A call's input: its arguments as the object they are (as written, where a call was cut
    short and they are not JSON)."""
    try:
        return orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return arguments
