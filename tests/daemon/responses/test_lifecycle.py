"""The engine over a response store that really fails: SQLite refusing writes (a read-only
connection) or running out of pages (``max_page_count``). A failure costs only the session whose
write failed; its records still go out; nothing raises into the tick loop.

(The same on a genuinely full filesystem, end to end: tests/e2e/test_store_failures.py.)
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from daemon.engine.core import Engine
from daemon.model.tokenizer import ByteTokenizer
from daemon.responses.store import ResponseStore
from ipc.records import (
    AbortCause,
    Admitted,
    Delta,
    Error,
    Finish,
    FinishReason,
    Message,
    RequestKind,
    ResponseFields,
    SamplingParams,
    Submit,
)
from ipc.response_records import ResponseGet, ResponseOp
from ipc.wire import ToProxy
from tests.support.engine_kit import settle
from tests.support.fake_runner import FakeRunner
from tests.support.wait import wait_for

TOK = ByteTokenizer()


def make_engine(store: ResponseStore) -> Engine:
    runner = FakeRunner(512, TOK.vocab_size, lambda ctx: ord("a"))
    return Engine(runner, TOK, store, 8, 256, 8192, "fake")


def response(rid: str, max_tokens: int = 8, background: bool = False) -> Submit:
    fields = ResponseFields(background=background, model="fake", input=[Message("user", "hi")])
    return Submit(rid, RequestKind.RESPONSE,
                  SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), response=fields)


def completion(rid: str, max_tokens: int) -> Submit:
    return Submit(rid, RequestKind.COMPLETION,
                  SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), prompts=["x"])


def run(engine: Engine) -> list[ToProxy]:
    out: list[ToProxy] = []
    for _ in range(20_000):
        out += settle(engine)
        if not engine.has_work:
            return out
        out += engine.step()
    raise AssertionError("the engine did not finish")


def finish(records: list[ToProxy], rid: str) -> Finish:
    [end] = [r for r in records if isinstance(r, Finish) and r.rid == rid]
    return end


def status(store: ResponseStore, rid: str) -> str | None:
    reply = store.handle_op(ResponseOp("op", ResponseGet(rid), 1), running=False)
    return None if reply.response is None else str(reply.response.status)


def store_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "tether.store" and r.levelno == logging.ERROR]


def test_a_read_only_store_costs_each_session_alone(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = ResponseStore(tmp_path / "responses.sqlite3", 100, 3600.0)
    engine = make_engine(store)
    for rid in ("resp_done", "resp_gone", "resp_bg"):
        assert engine.submit(response(rid, max_tokens=4 if rid == "resp_done" else 400,
                                      background=rid == "resp_bg")) == [Admitted(rid)]
    assert engine.submit(completion("other", 40)) == [Admitted("other")]
    out = settle(engine) + engine.step()
    store.db.execute("PRAGMA query_only = ON")  # SQLite now refuses every write
    with caplog.at_level(logging.ERROR):
        out += engine.step() + engine.step() + engine.step() + engine.step()
        out += settle(engine)
        end = finish(out, "resp_done")
        assert end.reason is FinishReason.ERROR and "could not be stored" in (end.message or "")
        assert "readonly" in (end.message or "")
        # Aborts and cancels whose placeholder cannot be touched still end their session.
        gone = engine.abort("resp_gone", AbortCause.CLIENT_DISCONNECT)
        cancelled = engine.abort("resp_bg", AbortCause.CANCEL)
        assert [f.reason for f in gone + cancelled] == [FinishReason.ABORT] * 2
        # A new stored response is refused with a clear error; a completion is untouched.
        [refused] = [r for r in engine.submit(response("resp_new")) + settle(engine)
                     if isinstance(r, Error)]
        assert refused.status == 500
        assert refused.code == "store_error" and "readonly" in refused.message
        rest = run(engine)
    other = [r for r in out + rest if getattr(r, "rid", None) == "other"]
    assert "".join(r.text for r in other if isinstance(r, Delta)) == "a" * 40
    assert finish(other, "other").reason is FinishReason.LENGTH
    assert engine.sessions == {} and engine.block_manager.num_used == 0
    assert store.num_placeholders() == 0
    logged = store_errors(caplog)
    for rid in ("resp_done", "resp_gone", "resp_bg", "resp_new"):
        assert any(rid in line for line in logged), (rid, logged)
    assert engine.figures.finished["error"] == 1

    store.db.execute("PRAGMA query_only = OFF")  # writable again: the store serves as before
    assert engine.submit(response("resp_later", max_tokens=3)) == [Admitted("resp_later")]
    assert finish(run(engine), "resp_later").reason is FinishReason.LENGTH
    assert status(store, "resp_later") == "incomplete"


def test_a_result_too_large_for_the_store_leaves_the_response_failed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The database may not grow (SQLITE_FULL): the 5,000-character output does not fit, the
    short failure note does, so a GET says failed rather than in progress forever."""
    store = ResponseStore(tmp_path / "responses.sqlite3", 100, 3600.0)
    engine = make_engine(store)
    assert engine.submit(response("resp_big", max_tokens=5000)) == [Admitted("resp_big")]
    pages = store.db.execute("PRAGMA page_count").one()[0]
    store.db.execute(f"PRAGMA max_page_count = {pages}")
    with caplog.at_level(logging.ERROR):
        out = run(engine)
    end = finish(out, "resp_big")
    assert end.reason is FinishReason.ERROR and "full" in (end.message or "")
    assert "".join(r.text for r in out if isinstance(r, Delta)) == "a" * 5000
    assert status(store, "resp_big") == "failed"
    assert any("resp_big" in line for line in store_errors(caplog))
    assert store.num_placeholders() == 0


def test_a_broken_store_answers_a_response_op_with_500(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = ResponseStore(tmp_path / "responses.sqlite3", 100, 3600.0)
    engine = make_engine(store)
    responses = engine.responses
    assert responses is not None
    store.db.close()
    with caplog.at_level(logging.ERROR):
        assert responses.put_op(ResponseOp("op", ResponseGet("resp_x"), 1)) is None
        wait_for(lambda: responses.has_reply, 10, "the store thread's reply")
        answered = responses.take_reply()
    assert answered is not None
    reply = answered[1]
    assert (reply.op_id, reply.status) == ("op", 500)
    assert (reply.message or "").startswith("response store error: ")
    assert any("resp_x" in line for line in store_errors(caplog))
