"""The Responses API streaming events of one response, built from engine records.

One `ResponseEvents` per response turns Delta / Finish records (or a failure) into the
OpenAI event sequence, numbering every event with ``sequence_number``:

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta ..., response.output_text.done,
    response.content_part.done, response.output_item.done,
    response.completed | response.incomplete | response.cancelled | response.failed

A response offered tools has its text parsed for calls by its format's parser (the chat path's,
proxy/tool_calls/): its content, if any, is the message, opened when the first content comes,
and each call is a ``function_call`` item after it: response.output_item.added,
response.function_call_arguments.delta ..., response.function_call_arguments.done,
response.output_item.done. A call of a custom tool is a ``custom_tool_call`` item instead, its
input the string argument it was offered with (proxy/openai/tool_requests.py), sent whole when the call
ends: response.custom_tool_call_input.delta, then .done (the JSON string is not decoded piece by
piece).

It also answers "what does the response look like now" (`snapshot`) for non-stream replies
and for a GET of a background response the daemon has not stored yet, and ends a stream that
lost sight of the engine with what the store recorded (`settle`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import msgspec

from ipc.records import AbortCause, Delta, Finish, FinishReason, Usage
from ipc.response_records import SHUTDOWN_REASON, ResponseStatus, StoredResponse
from proxy.http.errors import ApiError
from proxy.openai.tool_requests import (
    ResponsesTool,
    ResponsesToolChoice,
    call_name,
    custom_input,
    responses_tool_use,
)
from proxy.responses.response_object import (
    build_response,
    item_status,
    message_id,
    output_message,
    stored_response_object,
)
from proxy.tool_calls import call_ids
from proxy.tool_calls.parser import CallStart, Content, FormatParser
from proxy.tool_calls.parser import Event as Parsed

Event = dict[str, Any]

TERMINAL_EVENTS = {
    ResponseStatus.COMPLETED: "response.completed",
    ResponseStatus.INCOMPLETE: "response.incomplete",
    ResponseStatus.CANCELLED: "response.cancelled",
    ResponseStatus.FAILED: "response.failed",
}


@dataclasses.dataclass(slots=True, frozen=True)
class ResponseParams:
    """What the request fixed about the response object, echoed in every event."""

    id: str
    created_at: int
    model: str
    instructions: str | None
    previous_response_id: str | None
    background: bool
    store: bool
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    echo: dict[str, Any] | None = None  # what the object echoes of its request (ResponseFields.echo)
    conversation: str | None = None  # the conversation it is a turn of


@dataclasses.dataclass(slots=True, frozen=True)
class Outcome:
    """How a response ended."""

    status: ResponseStatus
    usage: Usage | None = None
    error: str | None = None
    incomplete_reason: str | None = None  # None: max_output_tokens


def finish_outcome(reason: FinishReason, usage: Usage, cause: AbortCause | None,
                   message: str | None, background: bool = False) -> Outcome:
    if reason is FinishReason.STOP:
        return Outcome(ResponseStatus.COMPLETED, usage)
    if reason is FinishReason.LENGTH:
        return Outcome(ResponseStatus.INCOMPLETE, usage)
    if reason is FinishReason.ABORT and cause is AbortCause.CANCEL:
        return Outcome(ResponseStatus.CANCELLED, usage)
    if reason is FinishReason.ABORT and cause is AbortCause.SHUTDOWN and background:
        # The daemon stopped: the store keeps what it had generated, as incomplete.
        return Outcome(ResponseStatus.INCOMPLETE, usage, incomplete_reason=SHUTDOWN_REASON)
    if reason is FinishReason.ABORT:
        # Shutdown, timeout or a lost proxy: nobody asked for it to stop, so it failed.
        return Outcome(ResponseStatus.FAILED, usage, f"generation aborted ({cause})")
    return Outcome(ResponseStatus.FAILED, usage, message or "generation failed")


def apply_record(events: ResponseEvents, record: Delta | Finish) -> list[Event]:
    """The events one engine record causes (n is 1: the only Finish ends the response)."""
    if isinstance(record, Delta):
        return events.delta(record.text)
    return events.finish(finish_outcome(record.reason, record.usage, record.cause, record.message,
                                        events.params.background))


class ResponseEvents:
    """The event sequence of one response; every method returns the events to send next."""

    def __init__(self, params: ResponseParams, calls: FormatParser | None = None,
                 custom: frozenset[str] = frozenset()) -> None:
        self.params = params
        self.item_id = message_id(params.id)
        self.status = ResponseStatus.QUEUED if params.background else ResponseStatus.IN_PROGRESS
        self.text_parts: list[str] = []  # the message's
        self.raw_parts: list[str] = []  # the output's, as it came (calls included)
        self.outcome: Outcome | None = None
        self.num_events = 0
        self.completed_at: float | None = None
        self.calls = calls  # the output may hold tool calls, parsed by it
        self.call_items: list[dict[str, Any]] = []  # the call items, in order
        self.custom = custom  # the names whose calls are custom_tool_call items
        self._arguments: list[str] = []  # each call's, as the model wrote them
        self._started = False
        self._item_open = False  # the message is in the output
        self._message_done = False

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def finished(self) -> bool:
        return self.outcome is not None

    def snapshot(self) -> dict[str, Any]:
        """The response object as it stands (queued / in progress / final)."""
        p, out = self.params, self.outcome
        output = []
        if self._item_open:
            done = self._message_done and self.call_items  # closed by the first call
            output.append(output_message(self.item_id, ResponseStatus.COMPLETED if done
                                         else self.status, self.text))
        output += [item if item["status"] != "in_progress" else
                   {**item, "status": item_status(self.status)} for item in self.call_items]
        return build_response(
            id=p.id, status=self.status, created_at=p.created_at, model=p.model,
            output_text=None, output=output,
            usage=out.usage if out else None, instructions=p.instructions,
            previous_response_id=p.previous_response_id, background=p.background, store=p.store,
            error=out.error if out else None,
            incomplete_reason=out.incomplete_reason if out else None,
            temperature=p.temperature, top_p=p.top_p, max_output_tokens=p.max_output_tokens,
            completed_at=self.completed_at, echo=p.echo, conversation=p.conversation,
        )

    def created(self) -> list[Event]:
        events = [self._event("response.created", response=self.snapshot())]
        if self.status is ResponseStatus.QUEUED:
            events.append(self._event("response.queued", response=self.snapshot()))
        return events

    def in_progress(self) -> list[Event]:
        """The engine started: in_progress, then the output message and its text part (with
        tools, the message waits for its first content)."""
        if self._started or self.finished:
            return []
        self.status = ResponseStatus.IN_PROGRESS
        self._started = True
        events = [self._event("response.in_progress", response=self.snapshot())]
        return events if self.calls is not None else events + self._open_message()

    def delta(self, text: str) -> list[Event]:
        events = self.in_progress()
        if text and not self.finished:
            self.raw_parts.append(text)
            events += self._text(text) if self.calls is None else self._parsed(
                self.calls.feed(text))
        return events

    def _open_message(self) -> list[Event]:
        self._item_open = True
        item = {"id": self.item_id, "type": "message", "status": "in_progress",
                "role": "assistant", "content": []}
        return [
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", **self._where(), part=self._part("")),
        ]

    def _text(self, text: str) -> list[Event]:
        self.text_parts.append(text)
        return [self._event("response.output_text.delta", **self._where(), delta=text,
                            logprobs=[])]

    def _parsed(self, parsed: list[Parsed]) -> list[Event]:
        """The events of what the parser read: content (before any call), calls begun, and
        their arguments (the last call's: calls come one after another)."""
        events: list[Event] = []
        for piece in parsed:
            if isinstance(piece, Content):
                events += ([] if self._item_open else self._open_message()) + self._text(
                    piece.text)
            elif isinstance(piece, CallStart):
                events += self._close_open(ResponseStatus.COMPLETED)
                self.call_items.append(self._call_item(piece))
                self._arguments.append("")
                events.append(self._event("response.output_item.added",
                                          output_index=self._call_index(),
                                          item=dict(self.call_items[-1])))
            else:
                item = self.call_items[-1]
                self._arguments[-1] += piece.text
                if item["type"] == "function_call":
                    item["arguments"] += piece.text
                    events.append(self._event("response.function_call_arguments.delta",
                                              item_id=item["id"],
                                              output_index=self._call_index(), delta=piece.text))
        return events

    def _call_item(self, call: CallStart) -> dict[str, Any]:
        serial = f"{self.params.id.removeprefix('resp_')}_{call.index}"
        if call.name in self.custom:
            return {"type": "custom_tool_call", "id": f"ctc_{serial}", "call_id": call.call_id,
                    "name": call.name, "input": "", "status": "in_progress"}
        return {"type": "function_call", "id": f"fc_{serial}", "call_id": call.call_id,
                **call_name(call.name), "arguments": "", "status": "in_progress"}

    def _call_index(self) -> int:
        """The output index of the last call (after the message, if there is one)."""
        return int(self._item_open) + len(self.call_items) - 1

    def _close_open(self, status: ResponseStatus) -> list[Event]:
        """The closing events of the item still open: the last call, else the message."""
        if self.call_items:
            item = self.call_items[-1]
            if item["status"] != "in_progress":
                return []
            item["status"] = status.value
            where = {"item_id": item["id"], "output_index": self._call_index()}
            if item["type"] == "function_call":
                events = [self._event("response.function_call_arguments.done", **where,
                                      arguments=item["arguments"])]
            else:
                item["input"] = custom_input(self._arguments[-1])
                events = [self._event("response.custom_tool_call_input.delta", **where,
                                      delta=item["input"]),
                          self._event("response.custom_tool_call_input.done", **where,
                                      input=item["input"])]
            events.append(self._event("response.output_item.done",
                                      output_index=where["output_index"], item=dict(item)))
            return events
        if not self._item_open or self._message_done:
            return []
        self._message_done = True
        return self._close_item(status)

    def _ending(self, status: ResponseStatus) -> list[Event]:
        """What the parser still held, then the open item closed: an output with nothing in it
        still has its (empty) message."""
        events = [] if self.calls is None else self._parsed(self.calls.end())
        if not (self._item_open or self.call_items):
            events += self._open_message()
        return events + self._close_open(status)

    def finish(self, outcome: Outcome) -> list[Event]:
        """Close the open text part and item, then the terminal event. Idempotent."""
        if self.finished:
            return []
        events = []
        if outcome.status in (ResponseStatus.COMPLETED, ResponseStatus.INCOMPLETE):
            events += self.in_progress() + self._ending(outcome.status)
        self.outcome = outcome
        self.status = outcome.status
        if outcome.status is ResponseStatus.COMPLETED:
            self.completed_at = time.time()
        events.append(self._event(TERMINAL_EVENTS[outcome.status], response=self.snapshot()))
        return events

    def settle(self, stored: StoredResponse) -> list[Event]:
        """The ending the store recorded, for a stream that lost sight of the engine on the way:
        the text it has not sent yet, the closing events, and the stored response itself in the
        terminal event, so that the stream and a GET agree. Idempotent, like `finish`."""
        if self.finished:
            return []
        events: list[Event] = []
        if stored.status in (ResponseStatus.COMPLETED, ResponseStatus.INCOMPLETE):
            text, sent = stored.output_text or "", "".join(self.raw_parts)
            if text.startswith(sent):
                events += self.delta(text[len(sent):])
            else:  # not what was streamed: the closing events carry the stored text whole
                events += self.in_progress()
                self.text_parts = [text]
            events += self._ending(stored.status)
        self.outcome = Outcome(stored.status, stored.usage, stored.error)
        self.status = stored.status
        self.completed_at = stored.completed_at
        events.append(self._event(TERMINAL_EVENTS[stored.status],
                                  response=stored_object(stored)))
        return events

    def error(self, message: str, code: str | None, param: str | None) -> list[Event]:
        """The ``error`` event (a rejected request), to be followed by `finish` with FAILED."""
        return [self._event("error", code=code, message=message, param=param)]

    def _close_item(self, status: ResponseStatus) -> list[Event]:
        text = self.text
        item = {"id": self.item_id, "type": "message", "status": status.value,
                "role": "assistant", "content": [self._part(text)]}
        return [
            self._event("response.output_text.done", **self._where(), text=text, logprobs=[]),
            self._event("response.content_part.done", **self._where(), part=self._part(text)),
            self._event("response.output_item.done", output_index=0, item=item),
        ]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": []}

    def _event(self, type_: str, **fields: Any) -> Event:
        event = {"type": type_, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return event


def stored_object(stored: StoredResponse) -> dict[str, Any]:
    """A stored response as the API answers with it. An output that may hold tool calls (the
    store keeps their format; the echoed request, the tools) is parsed again, as it streamed,
    so that a GET lists the same items the stream did."""
    fmt = stored.tool_call_format
    if fmt is None or stored.output_text is None:
        return stored_response_object(stored)
    echo = msgspec.json.decode(stored.echo)
    try:
        use = responses_tool_use(
            _typed(echo.get("tools"), list[ResponsesTool] | None),
            _typed(echo.get("tool_choice"), ResponsesToolChoice | None),
            echo.get("parallel_tool_calls"))
    except (msgspec.ValidationError, ApiError):  # a row no release of this code writes
        return stored_response_object(stored)
    parser = None if use is None else use.parser(fmt, call_ids(fmt, stored.id))
    if use is None or parser is None:
        return stored_response_object(stored)
    params = ResponseParams(
        id=stored.id, created_at=stored.created_at, model=stored.model,
        instructions=stored.instructions, previous_response_id=stored.previous_response_id,
        background=stored.background, store=True, temperature=stored.temperature,
        top_p=stored.top_p, max_output_tokens=stored.max_output_tokens, echo=echo,
        conversation=stored.conversation)
    events = ResponseEvents(params, parser, use.custom)
    events.delta(stored.output_text)
    events.finish(Outcome(stored.status, stored.usage, stored.error))
    return stored_response_object(stored, events.snapshot()["output"])


def _typed(value: Any, kind: Any) -> Any:
    # Through JSON: a tool's parameters are a msgspec.Raw.
    return msgspec.json.decode(msgspec.json.encode(value), type=kind)
