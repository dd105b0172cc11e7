"""The Responses API streaming events of one response, built from engine records.

One `ResponseEvents` per response turns Delta / Finish records (or a failure) into the
OpenAI event sequence, numbering every event with ``sequence_number``:

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta ..., response.output_text.done,
    response.content_part.done, response.output_item.done,
    response.completed | response.incomplete | response.cancelled | response.failed

It also answers "what does the response look like now" (`snapshot`) for non-stream replies
and for a GET of a background response the daemon has not stored yet, and ends a stream that
lost sight of the engine with what the store recorded (`settle`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ipc.records import (
    AbortCause,
    Delta,
    Finish,
    FinishReason,
    ResponseStatus,
    StoredResponse,
    Usage,
)
from proxy.response_object import build_response, message_id, stored_response_object

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
    conversation: str | None = None  # the conversation it is a turn of


@dataclasses.dataclass(slots=True, frozen=True)
class Outcome:
    """How a response ended."""

    status: ResponseStatus
    usage: Usage | None = None
    error: str | None = None


def finish_outcome(reason: FinishReason, usage: Usage, cause: AbortCause | None,
                   message: str | None) -> Outcome:
    if reason is FinishReason.STOP:
        return Outcome(ResponseStatus.COMPLETED, usage)
    if reason is FinishReason.LENGTH:
        return Outcome(ResponseStatus.INCOMPLETE, usage)
    if reason is FinishReason.ABORT and cause is AbortCause.CANCEL:
        return Outcome(ResponseStatus.CANCELLED, usage)
    if reason is FinishReason.ABORT:
        # Shutdown, timeout or a lost proxy: nobody asked for it to stop, so it failed.
        return Outcome(ResponseStatus.FAILED, usage, f"generation aborted ({cause})")
    return Outcome(ResponseStatus.FAILED, usage, message or "generation failed")


def apply_record(events: ResponseEvents, record: Delta | Finish) -> list[Event]:
    """The events one engine record causes (n is 1: the only Finish ends the response)."""
    if isinstance(record, Delta):
        return events.delta(record.text)
    return events.finish(finish_outcome(record.reason, record.usage, record.cause, record.message))


class ResponseEvents:
    """The event sequence of one response; every method returns the events to send next."""

    def __init__(self, params: ResponseParams) -> None:
        self.params = params
        self.item_id = message_id(params.id)
        self.status = ResponseStatus.QUEUED if params.background else ResponseStatus.IN_PROGRESS
        self.text_parts: list[str] = []
        self.outcome: Outcome | None = None
        self.num_events = 0
        self.completed_at: float | None = None
        self._item_open = False

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def finished(self) -> bool:
        return self.outcome is not None

    def snapshot(self) -> dict[str, Any]:
        """The response object as it stands (queued / in progress / final)."""
        p, out = self.params, self.outcome
        return build_response(
            id=p.id, status=self.status, created_at=p.created_at, model=p.model,
            output_text=self.text if self._item_open else None,
            usage=out.usage if out else None, instructions=p.instructions,
            previous_response_id=p.previous_response_id, background=p.background, store=p.store,
            error=out.error if out else None, output_id=self.item_id,
            temperature=p.temperature, top_p=p.top_p, max_output_tokens=p.max_output_tokens,
            completed_at=self.completed_at, conversation=p.conversation,
        )

    def created(self) -> list[Event]:
        events = [self._event("response.created", response=self.snapshot())]
        if self.status is ResponseStatus.QUEUED:
            events.append(self._event("response.queued", response=self.snapshot()))
        return events

    def in_progress(self) -> list[Event]:
        """The engine started: in_progress, then the (single) output message and text part."""
        if self._item_open or self.finished:
            return []
        self.status = ResponseStatus.IN_PROGRESS
        self._item_open = True
        item = {"id": self.item_id, "type": "message", "status": "in_progress",
                "role": "assistant", "content": []}
        return [
            self._event("response.in_progress", response=self.snapshot()),
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", **self._where(), part=self._part("")),
        ]

    def delta(self, text: str) -> list[Event]:
        events = self.in_progress()
        if text and not self.finished:
            self.text_parts.append(text)
            events.append(self._event("response.output_text.delta", **self._where(), delta=text,
                                      logprobs=[]))
        return events

    def finish(self, outcome: Outcome) -> list[Event]:
        """Close the open text part and item, then the terminal event. Idempotent."""
        if self.finished:
            return []
        events = []
        if outcome.status in (ResponseStatus.COMPLETED, ResponseStatus.INCOMPLETE):
            events += self.in_progress() + self._close_item(outcome.status)
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
            text = stored.output_text or ""
            if text.startswith(self.text):
                events += self.delta(text[len(self.text):])
            else:  # not what was streamed: the closing events carry the stored text whole
                events += self.in_progress()
                self.text_parts = [text]
            events += self._close_item(stored.status)
        self.outcome = Outcome(stored.status, stored.usage, stored.error)
        self.status = stored.status
        self.completed_at = stored.completed_at
        events.append(self._event(TERMINAL_EVENTS[stored.status],
                                  response=stored_response_object(stored)))
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
