"""A session's held records: what a reader takes at once, and what stays held until handed on."""

from __future__ import annotations

import pytest

from ipc.reasons import Reason
from ipc.records import (
    Delta,
    Error,
    Finish,
    FinishReason,
    Pause,
    RequestKind,
    Resume,
    SamplingParams,
    Submit,
    Usage,
)
from proxy.engine.session import Flow, Phase, Session
from proxy.http.errors import ApiError


def session(sequences: int = 1, logprobs: int | None = None, high_water: int = 1024,
            sent: list[Pause | Resume] | None = None) -> Session:
    submit = Submit(rid="r", epoch=1, kind=RequestKind.COMPLETION,
                    sampling=SamplingParams(logprobs=logprobs), prompts=["p"], n=sequences)
    control = (lambda record: sent.append(record) is None) if sent is not None else lambda _: True
    return Session(submit, Flow(high_water, 1, control), detached=False, deadline=0.0)


def delta(index: int, *ids: int) -> Delta:
    return Delta("r", index, "x" * len(ids), list(ids))


def finish(index: int, reason: FinishReason = FinishReason.LENGTH) -> Finish:
    return Finish("r", index, reason, Usage(1, 1))


def test_a_reader_takes_everything_held_and_wakes_once() -> None:
    s = session(logprobs=2)
    assert [s.push(r) for r in (delta(0, 1), delta(0, 2, 3))] == [True, False]
    assert (s.held, s.units) == (2, 9)  # 3 tokens, each with 2 alternatives
    batch = s.take()
    assert batch == [delta(0, 1), delta(0, 2, 3)] and s.records == []
    assert (s.held, s.units) == (2, 9)  # held until handed on
    s.handed_on()
    assert (s.held, s.units, s.consumed) == (0, 0, 2)


def test_take_stops_at_the_last_finish_and_drops_what_follows() -> None:
    s = session(sequences=2)
    for record in (delta(0, 1), finish(0), delta(1, 2), finish(1), delta(1, 3)):
        s.push(record)
    assert s.take() == [delta(0, 1), finish(0), delta(1, 2), finish(1)]
    assert s.complete and s.records == [] and s.phase is Phase.DONE and not s.needs_abort()


def test_an_error_after_records_is_raised_by_the_next_take() -> None:
    s = session()
    error = Error("r", "too long", Reason.CONTEXT_LENGTH_EXCEEDED, "prompt")
    for record in (delta(0, 1), error):
        s.push(record)
    assert s.take() == [delta(0, 1)]
    with pytest.raises(ApiError) as info:
        s.take()
    assert (info.value.status, info.value.param) == (400, "prompt") and s.phase is Phase.DONE


def test_a_session_the_daemon_ended_needs_no_abort() -> None:
    s = session()
    s.push(finish(0, FinishReason.ABORT))
    s.take()
    assert s.complete and s.phase is Phase.DONE and not s.needs_abort()


def test_a_session_the_daemon_aborted_is_done_before_its_last_finish() -> None:
    s = session(sequences=2)
    s.push(finish(0, FinishReason.ABORT))
    assert s.take() == [finish(0, FinishReason.ABORT)]
    assert not s.complete and s.phase is Phase.DONE and not s.needs_abort()


def test_past_the_high_water_mark_it_pauses_and_resumes_at_half() -> None:
    sent: list[Pause | Resume] = []
    s = session(high_water=4, sent=sent)
    for token in range(5):
        s.push(delta(0, token))
    assert sent == [Pause("r")] and s.paused and s.pause_sent
    s.take()
    s.handed_on()
    assert sent == [Pause("r"), Resume("r")] and not s.paused and not s.pause_sent


def test_a_pause_the_pipe_refused_stays_wanted_for_the_sweep() -> None:
    s = session(high_water=1)
    s.flow.control = lambda _record: False
    s.push(delta(0, 1, 2))
    assert s.paused and not s.pause_sent  # the sweep sends it again


def test_a_lost_daemon_never_hides_an_end_it_already_sent() -> None:
    """The daemon's last records and its Goodbye can come in one read: a session whose every
    sequence's Finish is held keeps them for its reader (a background response stopped by
    the daemon's shutdown is then told incomplete, not left waiting for a next daemon)."""
    lost = ApiError(503, "the engine is unavailable", code="engine_unavailable")
    ended = session(sequences=2)
    for record in [delta(0, 1), finish(0), delta(1, 2), finish(1, FinishReason.ABORT)]:
        ended.push(record)
    ended.lose(lost)
    assert [type(r) for r in ended.take()] == [Delta, Finish, Delta, Finish]
    refused = session()
    refused.push(Error("r", "no", Reason.INVALID))
    refused.lose(lost)
    with pytest.raises(ApiError) as info:
        refused.take()
    assert info.value.status == 400  # the daemon's own refusal, not the loss
    unended = session(sequences=2)
    for record in [delta(0, 1), finish(0), delta(1, 2)]:
        unended.push(record)
    unended.lose(lost)
    with pytest.raises(ApiError) as info:
        unended.take()
    assert info.value is lost
