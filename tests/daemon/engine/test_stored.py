"""Stored Responses turns on the store thread (daemon/engine/stored.py): the engine never waits
for the store, a turn that ends while it loads leaves nothing, and a completed turn's client
hears it only once it is stored. The store is the real one, held at a gate where a slow
database would keep it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from daemon.engine.stored import LOAD_TIMEOUT_S
from daemon.responses.store import ResponseStore
from ipc.records import (
    AbortCause,
    Admitted,
    Error,
    Finish,
    FinishReason,
    Message,
    RequestKind,
    ResponseFields,
    SamplingParams,
    Submit,
)
from ipc.response_records import ResponseCancel, ResponseGet, ResponseOp
from ipc.wire import ToProxy
from tests.support.engine_kit import completion, make_engine, run, settle, texts


class GatedStore(ResponseStore):
    """A store whose ``begin`` or ``complete`` waits at a gate until the test opens it."""

    def __init__(self, *args: Any, gate: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = gate
        self.reached = threading.Event()
        self.open = threading.Event()

    def _wait(self, name: str) -> None:
        if name == self.gate:
            self.reached.set()
            assert self.open.wait(30), "the test never opened the gate"

    def begin(self, submit: Submit) -> None:
        self._wait("begin")
        super().begin(submit)

    def complete(self, *args: Any, **kwargs: Any) -> bool:
        self._wait("complete")
        return super().complete(*args, **kwargs)


def response(rid: str, background: bool = False, max_tokens: int = 6) -> Submit:
    fields = ResponseFields(background=background, input=[Message("user", "hi")], model="fake")
    return Submit(rid, RequestKind.RESPONSE,
                  SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                  response=fields, epoch=1)


def status(store: ResponseStore, rid: str) -> str | None:
    reply = store.handle_op(ResponseOp("op", ResponseGet(rid), 1), running=False)
    return None if reply.response is None else str(reply.response.status)


def finishes(records: list[ToProxy], rid: str) -> list[Finish]:
    return [r for r in records if isinstance(r, Finish) and r.rid == rid]


def test_a_turn_that_ends_while_it_loads_is_evicted_at_once_and_leaves_nothing() -> None:
    """Its placeholder is being written when its client leaves: the abort ends it at once
    (the engine runs another request meanwhile), it is never prefilled, and the placeholder
    the load wrote is removed after it."""
    store = GatedStore(None, 100, 3600.0, gate="begin")
    engine, _ = make_engine(lambda ctx: ord("a"), store=store)
    assert engine.submit(response("resp_1")) == [Admitted("resp_1")]
    assert engine.submit(completion("other", max_tokens=5, temperature=0.0)) == [Admitted("other")]
    assert store.reached.wait(30)
    out: list[ToProxy] = []
    while engine.has_work:  # the other request runs to its end; the store is still held
        out += engine.step()
    assert texts(out, "other") == {0: "aaaaa"} and engine.is_running("resp_1")
    [end] = engine.abort("resp_1", AbortCause.CLIENT_DISCONNECT)
    assert (end.reason, end.cause) == (FinishReason.ABORT, AbortCause.CLIENT_DISCONNECT)
    assert not engine.is_running("resp_1") and engine.stats().waiting == 0
    store.open.set()
    assert settle(engine) == []  # its load came back to nobody
    assert status(store, "resp_1") is None and store.num_placeholders() == 0
    assert engine.figures.tick_log and not any("resp_1" in t.rids for t in engine.figures.tick_log)


def test_a_completed_turn_is_heard_only_once_it_is_stored() -> None:
    store = GatedStore(None, 100, 3600.0, gate="complete")
    engine, _ = make_engine(lambda ctx: ord("a"), store=store)
    engine.submit(response("resp_1"))
    out = settle(engine)
    while engine.has_work:
        out += engine.step()
    assert store.reached.wait(30)
    assert finishes(out, "resp_1") == [] and engine.waiting_for_store
    assert engine.stats().placeholders == 1  # its row is a placeholder until then
    assert status(store, "resp_1") == "in_progress"
    store.open.set()
    [end] = finishes(run(engine), "resp_1")
    assert end.reason is FinishReason.LENGTH and status(store, "resp_1") == "incomplete"
    assert engine.stats().placeholders == 0 and not engine.waiting_for_store


def test_a_cancel_that_wins_over_the_last_tokens_ends_the_turn_cancelled(
        tmp_path: Path) -> None:
    """Another replica cancels the background response while its result is on its way to the
    store: the result is not stored, the row stays cancelled, and its client hears cancelled,
    never an ending the store contradicts."""
    store = GatedStore(tmp_path / "store.db", 100, 3600.0, gate="complete")
    engine, _ = make_engine(lambda ctx: ord("a"), store=store)
    engine.submit(response("resp_bg", background=True))
    out = settle(engine)
    while engine.has_work:
        out += engine.step()
    assert store.reached.wait(30)
    other = ResponseStore(tmp_path / "store.db", 100, 3600.0, replica_id="other")
    assert other.handle_op(ResponseOp("op", ResponseCancel("resp_bg"), 1), False).status == 200
    store.open.set()
    [end] = finishes(out + run(engine), "resp_bg")
    assert (end.reason, end.cause) == (FinishReason.ABORT, AbortCause.CANCEL)
    assert status(store, "resp_bg") == "cancelled"
    other.close()


def test_a_load_the_store_never_answers_is_a_503_and_leaves_nothing() -> None:
    """A store that hangs rather than fails: past LOAD_TIMEOUT_S the turn is refused, 503, and
    what its load wrote once the store came back is removed."""
    store = GatedStore(None, 100, 3600.0, gate="begin")
    engine, _ = make_engine(lambda ctx: ord("a"), store=store)
    engine.submit(response("resp_1"))
    assert store.reached.wait(30)
    assert engine.from_store() == []
    engine.clock.now += LOAD_TIMEOUT_S  # type: ignore[attr-defined]
    [error] = engine.from_store()
    assert isinstance(error, Error) and (error.status, error.code) == (503, "store_timeout")
    assert not engine.is_running("resp_1") and not engine.waiting_for_store
    store.open.set()
    assert settle(engine) == []
    assert status(store, "resp_1") is None and store.num_placeholders() == 0
