"""The Responses event sequence, checked against the openai SDK's own event types."""

from __future__ import annotations

import asyncio
import gc
import json
import weakref
from typing import Any

import orjson
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from ipc.records import AbortCause, FinishReason, ToolCallFormat, Usage
from ipc.response_records import SHUTDOWN_REASON, ResponseStatus, StoredResponse
from proxy.http.errors import ApiError
from proxy.responses.background import BackgroundRegistry, BackgroundRun
from proxy.responses.events import Outcome, ResponseEvents, ResponseParams, finish_outcome
from proxy.responses.response_object import stored_response_object
from proxy.tool_calls import call_ids
from proxy.tool_calls.hermes import HermesParser

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


def test_a_background_response_stopped_by_shutdown_is_incomplete_as_the_store_says() -> None:
    """The stream tells what the daemon stores: incomplete, with the text and usage it had,
    and a reason OpenAI's object can hold (null: it names none for a server that stopped)."""
    events = ResponseEvents(params(background=True))
    sent = events.created() + events.delta("part")
    sent += events.finish(finish_outcome(FinishReason.ABORT, Usage(3, 1), AbortCause.SHUTDOWN,
                                         None, background=True))
    final = Response.model_validate(sent[-1]["response"])
    assert sent[-1]["type"] == "response.incomplete" and final.status == "incomplete"
    assert final.output_text == "part" and final.usage is not None
    assert final.incomplete_details is not None and final.incomplete_details.reason is None
    stored = StoredResponse("resp_x", ResponseStatus.INCOMPLETE, 1, "m", True, output_text="part",
                            usage=Usage(3, 1), incomplete_reason=SHUTDOWN_REASON)
    assert stored_response_object(stored)["incomplete_details"] == {"reason": None}


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


def test_settle_ends_with_what_the_store_recorded() -> None:
    """A stream that lost sight of the engine: the rest of the stored text, the closing events,
    and the stored response itself in the terminal event."""
    events = ResponseEvents(params_for("resp_s"))
    sent = events.created() + events.delta("Hel")
    stored = StoredResponse(id="resp_s", status=ResponseStatus.INCOMPLETE, created_at=1,
                            model="m", background=True, completed_at=5.0, output_text="Hello",
                            usage=Usage(3, 2), incomplete_reason="max_output_tokens")
    sent += events.settle(stored)
    assert [e["type"] for e in sent][-5:] == [
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert sent[-5]["delta"] == "lo" and sent[-4]["text"] == "Hello"
    assert sent[-1]["response"] == stored_response_object(stored)
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    for event in sent:
        STREAM_EVENTS.validate_python(event)
    assert events.settle(stored) == [] and events.finish(Outcome(ResponseStatus.FAILED)) == []


def _run_of(rid: str, deltas: int) -> BackgroundRun:
    run = BackgroundRun(ResponseEvents(params_for(rid)))
    for i in range(deltas):
        run.publish(run.events.delta(f"word{i} "))
    return run


def test_the_registry_lets_finished_runs_go_first_past_its_byte_bound() -> None:
    one = _run_of("resp_one", 10)
    registry = BackgroundRegistry(max_history_bytes=int(one.history.nbytes * 2.5))
    registry.add(one)
    one.end(Outcome(ResponseStatus.COMPLETED))
    two = _run_of("resp_two", 0)
    registry.add(two)
    for i in range(10):
        two.publish(two.events.delta(f"word{i} "))
    assert registry.get("resp_one") is not None  # still room for both
    three = _run_of("resp_three", 0)
    registry.add(three)
    for i in range(10):
        three.publish(three.events.delta(f"word{i} "))
    assert registry.get("resp_one") is None  # finished: the first to go
    assert registry.get("resp_two") is not None and two.history.first == 0
    assert registry.history_bytes == two.history.nbytes + three.history.nbytes
    assert registry.history_bytes <= registry.max_history_bytes


def test_a_run_past_the_byte_bound_lets_its_oldest_events_go() -> None:
    async def scenario() -> None:
        run = BackgroundRun(ResponseEvents(params_for("resp_big")))
        registry = BackgroundRegistry(max_history_bytes=2000)
        registry.add(run)
        lagging = run.subscribe()
        assert (await anext(lagging))[0]["type"] == "response.created"
        for i in range(100):
            run.publish(run.events.delta(f"word{i} "))
        run.end(Outcome(ResponseStatus.COMPLETED))
        first = run.history.first
        assert first > 0 and registry.history_bytes == run.history.nbytes
        assert run.history.nbytes - len(orjson.dumps(run.history[-1])) <= 2000
        # A reader behind what is held is told where to resume, and its stream ends.
        notice = await anext(lagging)
        assert notice[0]["type"] == "error" and notice[0]["code"] == "events_let_go"
        assert notice[0]["sequence_number"] == first - 1
        assert f"starting_after={first - 1}" in notice[0]["message"]
        assert [batch async for batch in lagging] == []
        with pytest.raises(ApiError) as gone:
            run.subscribe()
        assert gone.value.param == "starting_after" and f"starting_after={first - 1}" in \
            gone.value.message
        held = [e async for batch in run.subscribe(first - 1) for e in batch]
        assert held[0]["sequence_number"] == first and held[-1]["type"] == "response.completed"

    asyncio.run(scenario())


def test_starting_after_must_name_an_event_sent() -> None:
    run = BackgroundRun(ResponseEvents(params_for("resp_end")))
    run.end(Outcome(ResponseStatus.CANCELLED))
    last = len(run.history) - 1
    with pytest.raises(ApiError) as past:
        run.subscribe(last + 1)
    assert past.value.status == 400 and past.value.param == "starting_after"
    assert f"is {last}" in past.value.message

    async def after_the_last() -> list[list[dict[str, object]]]:
        return [batch async for batch in run.subscribe(last)]

    assert asyncio.run(after_the_last()) == []


def test_a_live_run_asked_past_its_end_ends_with_its_last_event() -> None:
    async def scenario() -> list[str]:
        run = BackgroundRun(ResponseEvents(params_for("resp_live")))
        ahead = run.subscribe(len(run.history) + 10)
        reading = asyncio.create_task(anext(ahead))
        await asyncio.sleep(0.01)
        assert not reading.done()  # waits for events not sent yet
        run.end(Outcome(ResponseStatus.CANCELLED))
        return [e["type"] for e in await reading]

    assert asyncio.run(scenario()) == ["response.cancelled"]


def _with_calls(rid: str = "resp_t", custom: frozenset[str] = frozenset()) -> ResponseEvents:
    names = frozenset({"get_weather"}) | custom
    return ResponseEvents(params_for(rid, background=False),
                          HermesParser(names, call_ids(ToolCallFormat.HERMES, rid)), custom)


def _streamed(events: ResponseEvents, text: str, cut: int) -> list[dict[str, Any]]:
    """Every event of `text` fed in pieces of `cut` characters, each one checked by the SDK."""
    sent = events.created()
    for i in range(0, len(text), cut):
        sent += events.delta(text[i:i + cut])
    sent += events.finish(finish_outcome(FinishReason.STOP, Usage(3, 20), None, None))
    for event in sent:
        STREAM_EVENTS.validate_python(event)
    return sent


CALLS_TEXT = ('Looking. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
              '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
              '</tool_call>')


@pytest.mark.parametrize("cut", [1, 7, len(CALLS_TEXT)])
def test_tool_calls_are_function_call_items_after_the_message(cut: int) -> None:
    events = _with_calls()
    sent = _streamed(events, CALLS_TEXT, cut)
    kinds = [e["type"] for e in sent if not e["type"].endswith(".delta")]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.done",
        "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    final = Response.model_validate(sent[-1]["response"])
    assert final.output_text == "Looking."
    calls = final.output[1:]
    assert [(c.type, c.name, json.loads(c.arguments), c.status) for c in calls] == [
        ("function_call", "get_weather", {"city": "Paris"}, "completed"),
        ("function_call", "get_weather", {"city": "Oslo"}, "completed")]
    assert [c.call_id for c in calls] == ["call_t_0", "call_t_1"]
    args = "".join(e["delta"] for e in sent if e["type"].endswith("arguments.delta")
                   and e["output_index"] == 1)
    assert json.loads(args) == {"city": "Paris"}
    assert sent[-1]["response"] == events.snapshot()


def test_a_call_alone_has_no_message_and_a_cut_call_is_incomplete() -> None:
    events = _with_calls()
    sent = events.delta('<tool_call>{"name": "get_weather", "arguments": {"ci')
    assert [e["type"] for e in sent][:2] == ["response.in_progress", "response.output_item.added"]
    assert events.snapshot()["output"][0]["status"] == "in_progress"
    sent = events.finish(finish_outcome(FinishReason.LENGTH, Usage(3, 9), None, None))
    final = sent[-1]["response"]
    assert [(i["type"], i["status"]) for i in final["output"]] == [("function_call", "incomplete")]


def test_with_tools_an_empty_output_still_has_its_message() -> None:
    events = _with_calls()
    sent = events.finish(finish_outcome(FinishReason.STOP, Usage(3, 0), None, None))
    assert [i["type"] for i in sent[-1]["response"]["output"]] == ["message"]


PATCH = "*** Begin Patch\n*** Add File: a.txt\n+\"hi\"\n*** End Patch"
CUSTOM_TEXT = ('<tool_call>{"name": "apply_patch", "arguments": '
               + json.dumps({"input": PATCH}) + '}</tool_call>')


@pytest.mark.parametrize("cut", [1, 5, len(CUSTOM_TEXT)])
def test_a_custom_tools_call_is_a_custom_tool_call_item_with_its_input(cut: int) -> None:
    events = _with_calls("resp_c", frozenset({"apply_patch"}))
    sent = _streamed(events, CUSTOM_TEXT, cut)
    assert [e["type"] for e in sent] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done",
        "response.output_item.done", "response.completed"]
    assert sent[3]["delta"] == sent[4]["input"] == PATCH
    [call] = Response.model_validate(sent[-1]["response"]).output
    assert (call.type, call.id, call.call_id, call.name, call.input) == (
        "custom_tool_call", "ctc_c_0", "call_c_0", "apply_patch", PATCH)
    assert sent[-1]["response"] == events.snapshot()
