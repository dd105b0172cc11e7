"""The Responses event sequence, checked against the openai SDK's own event types."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from ipc.records import AbortCause, FinishReason, ResponseStatus, Usage
from proxy.errors import ApiError
from proxy.responses_background import BackgroundRegistry, BackgroundRun
from proxy.responses_events import Outcome, ResponseEvents, ResponseParams, finish_outcome

STREAM_EVENTS = TypeAdapter(ResponseStreamEvent)


def params(background: bool = False) -> ResponseParams:
    return params_for("resp_x", background)


def params_for(rid: str, background: bool = True) -> ResponseParams:
    return ResponseParams(id=rid, created_at=1, model="m", instructions=None,
                          previous_response_id=None, background=background, store=True,
                          temperature=1.0, top_p=1.0, max_output_tokens=None)


def test_a_finished_response_emits_the_full_typed_sequence() -> None:
    events = ResponseEvents(params())
    sent = events.created() + events.delta("Hel") + events.delta("lo")
    sent += events.finish(finish_outcome(FinishReason.STOP, Usage(3, 2, 1), None, None))
    assert [e["type"] for e in sent] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    for event in sent:
        STREAM_EVENTS.validate_python(event)
    final = sent[-1]["response"]
    assert final["status"] == "completed" and final["completed_at"] is not None
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["total_tokens"] == 5
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 1


def test_a_finish_without_text_still_opens_and_closes_the_message() -> None:
    events = ResponseEvents(params())
    sent = events.finish(finish_outcome(FinishReason.LENGTH, Usage(3, 0), None, None))
    assert [e["type"] for e in sent][-4:] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]
    assert sent[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_only_one_terminal_event_is_ever_emitted() -> None:
    events = ResponseEvents(params(background=True))
    assert [e["type"] for e in events.created()] == ["response.created", "response.queued"]
    cancelled = events.finish(finish_outcome(FinishReason.ABORT, Usage(3, 0),
                                             AbortCause.CANCEL, None))
    assert [e["type"] for e in cancelled] == ["response.cancelled"]
    assert events.finish(finish_outcome(FinishReason.STOP, Usage(3, 1), None, None)) == []
    assert events.delta("late") == []
    assert events.snapshot()["status"] == "cancelled"


def test_an_abort_nobody_asked_for_is_a_failure() -> None:
    outcome = finish_outcome(FinishReason.ABORT, Usage(1, 1), AbortCause.SHUTDOWN, None)
    assert outcome.status is ResponseStatus.FAILED and "shutdown" in (outcome.error or "")


def test_the_background_registry_is_bounded_and_evicts_finished_runs_first() -> None:
    registry = BackgroundRegistry(max_runs=2)
    runs = [BackgroundRun(ResponseEvents(params_for(f"resp_{i}"))) for i in range(3)]
    registry.add(runs[0])
    registry.add(runs[1])
    with pytest.raises(ApiError) as refused:
        registry.add(runs[2])
    assert refused.value.status == 429
    runs[0].end(Outcome(ResponseStatus.CANCELLED))
    registry.add(runs[2])
    assert registry.get("resp_0") is None and len(registry) == 2


def test_finished_runs_expire_with_no_new_run_added() -> None:
    async def scenario() -> tuple[int, int]:
        registry = BackgroundRegistry(keep_finished_s=0.05)
        done, running = (BackgroundRun(ResponseEvents(params_for(f"resp_{k}")))
                         for k in ("done", "running"))
        registry.add(done)
        registry.add(running)
        done.end(Outcome(ResponseStatus.COMPLETED))
        held = len(registry)
        await asyncio.sleep(0.3)
        return held, len(registry)

    assert asyncio.run(scenario()) == (2, 1)


def test_a_run_dropped_before_its_expiry_is_not_kept_alive() -> None:
    """A finished run pushed out by the cap (or deleted) frees its history at once: its expiry
    timer must not hold it for keep_finished_s (a soak at ~50 background responses/s grew the
    proxy by 190 MiB in 10 minutes that way)."""
    async def scenario() -> tuple[bool, bool]:
        registry = BackgroundRegistry(max_runs=1, keep_finished_s=600)
        first = BackgroundRun(ResponseEvents(params_for("resp_first")))
        registry.add(first)
        first.end(Outcome(ResponseStatus.COMPLETED))
        registry.add(BackgroundRun(ResponseEvents(params_for("resp_second"))))
        dropped = weakref.ref(first)
        del first
        gc.collect()
        return registry.get("resp_first") is None, dropped() is None

    assert asyncio.run(scenario()) == (True, True)


def test_a_late_reader_gets_every_event_then_the_end() -> None:
    run = BackgroundRun(ResponseEvents(params_for("resp_r")))
    run.publish(run.events.delta("a"))
    run.end(Outcome(ResponseStatus.FAILED, error="daemon lost"))

    async def read() -> list[str]:
        return [e["type"] async for batch in run.subscribe(starting_after=1) for e in batch]

    assert asyncio.run(read()) == [
        "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.failed"]
