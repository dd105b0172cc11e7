"""The engine with a response store: responses stored, continued and evicted with their
placeholder, background ones kept through a proxy's loss."""

import msgspec

from daemon.responses.store import ResponseStore
from ipc.records import (
    AbortCause,
    Error,
    Message,
    RequestKind,
    ResponseFields,
    SamplingParams,
    Submit,
)
from ipc.response_records import SHUTDOWN_REASON, ResponseGet, ResponseOp
from tests.support.engine_kit import EOS, TOK, completion, make_engine, run, settle


def response(rid: str, text: str, previous: str | None = None,
             background: bool = False) -> Submit:
    fields = ResponseFields(previous_response_id=previous, background=background,
                            input=[Message("user", text)], model="fake")
    return Submit(rid, RequestKind.RESPONSE, SamplingParams(max_tokens=30, temperature=0.0),
                  response=fields, epoch=1)


def get(store: ResponseStore, rid: str) -> tuple[int, dict | None]:
    reply = store.handle_op(ResponseOp("op", ResponseGet(rid), 1), running=False)
    return reply.status, None if reply.response is None else msgspec.to_builtins(reply.response)


def test_response_is_stored_and_continued():
    store = ResponseStore(None, 100, 3600.0)
    engine, runner = make_engine(lambda ctx: EOS if ctx[-1] == ord("!") else ord("!"),
                                 store=store)
    engine.submit(response("resp_1", "first"))
    settle(engine)
    assert store.num_placeholders() == 1
    run(engine)
    status, body = get(store, "resp_1")
    assert status == 200 and body is not None and body["status"] == "completed"
    engine.submit(response("resp_2", "second", previous="resp_1"))
    run(engine)
    assert "first" in TOK.decode(runner.context(runner.passes[-2][0]))
    assert store.num_placeholders() == 0


def test_unknown_previous_response_is_404():
    engine, _ = make_engine(store=ResponseStore(None, 100, 3600.0))
    out = engine.submit(response("resp_x", "hi", previous="resp_missing")) + settle(engine)
    [err] = [r for r in out if isinstance(r, Error)]
    assert (err.status, err.param) == (404, "previous_response_id")


def test_foreground_abort_removes_the_placeholder_background_cancel_keeps_it():
    store = ResponseStore(None, 100, 3600.0)
    engine, _ = make_engine(lambda ctx: ord("a"), store=store)
    engine.submit(response("resp_fg", "x"))
    engine.submit(response("resp_bg", "y", background=True))
    settle(engine)
    engine.step()
    engine.abort("resp_fg", AbortCause.CLIENT_DISCONNECT)
    engine.abort("resp_bg", AbortCause.CANCEL)
    settle(engine)
    assert get(store, "resp_fg")[0] == 404
    status, body = get(store, "resp_bg")
    assert status == 200 and body is not None and body["status"] == "cancelled"
    assert store.num_placeholders() == 0


def test_background_response_is_queued_until_its_first_tick():
    store = ResponseStore(None, 100, 3600.0)
    engine, _ = make_engine(lambda ctx: ord("a"), store=store)
    engine.submit(response("resp_bg", "y", background=True))
    settle(engine)
    assert get(store, "resp_bg")[1]["status"] == "queued"  # type: ignore[index]
    engine.step()
    settle(engine)
    assert get(store, "resp_bg")[1]["status"] == "in_progress"  # type: ignore[index]
    run(engine)
    assert get(store, "resp_bg")[1]["status"] == "incomplete"  # type: ignore[index]


def test_proxy_loss_keeps_background_responses_running():
    store = ResponseStore(None, 100, 3600.0)
    engine, _ = make_engine(lambda ctx: ord("a"), store=store)
    engine.submit(completion("c", max_tokens=50))
    engine.submit(response("resp_bg", "y", background=True))
    settle(engine)
    engine.step()
    out = engine.abort_all(AbortCause.PROXY_LOST)
    assert {r.rid for r in out} == {"c"}
    run(engine)
    assert get(store, "resp_bg")[1]["status"] in ("completed", "incomplete")  # type: ignore[index]


def test_a_background_response_stopped_by_shutdown_is_stored_incomplete_with_what_it_had():
    """What it generated is its result: incomplete, its text and usage kept (failed, empty,
    before); a foreground one still leaves no placeholder."""
    store = ResponseStore(None, 100, 3600.0)
    engine, _ = make_engine(lambda ctx: ord("a"), store=store)
    engine.submit(response("resp_bg", "y", background=True))
    engine.submit(response("resp_fg", "z"))
    settle(engine)
    for _ in range(5):
        engine.step()
    engine.abort_all(AbortCause.SHUTDOWN)
    settle(engine)
    _, body = get(store, "resp_bg")
    assert body is not None and body["status"] == "incomplete"
    assert body["incomplete_reason"] == SHUTDOWN_REASON and body["error"] is None
    assert body["output_text"] == "aaaaa"
    assert body["usage"]["completion_tokens"] == 5 and body["usage"]["prompt_tokens"] > 0
    assert get(store, "resp_fg")[0] == 404
