"""The responses room's thread: the engine's jobs in order, ops in the order of arrival with
them (an op sees every job given before it, and waits for no job given after it), and the
replies it runs ahead of the tick bounded."""

from __future__ import annotations

import threading

from daemon.responses.keeper import Keeper
from daemon.responses.store import ResponseStore
from daemon.responses.store_thread import StoreThread
from ipc.records import Message, RequestKind, ResponseFields, SamplingParams, Submit, Usage
from ipc.response_records import ResponseGet, ResponseOp
from tests.support.wait import wait_for


def _thread(**kwargs: int) -> tuple[StoreThread, ResponseStore]:
    store = ResponseStore(None, 100, 3600.0)
    return StoreThread(Keeper(store), **kwargs), store


def _get(rid: str, op_id: str = "op") -> ResponseOp:
    return ResponseOp(op_id, ResponseGet(rid), 1)


def _submit(rid: str) -> Submit:
    fields = ResponseFields(input=[Message("user", "hi")], model="fake")
    return Submit(rid, RequestKind.RESPONSE, SamplingParams(max_tokens=4), response=fields)


def test_an_op_sees_the_jobs_given_before_it_and_waits_for_none_after() -> None:
    """However busy the engine keeps the thread, an op is answered in its turn: after the jobs
    the tick gave before it (it sees the placeholder one wrote), before the ones after."""
    thread, store = _thread()
    gate = threading.Event()
    seen: list[bool] = []
    thread.do(lambda keeper: gate.wait(10) and None)
    thread.do(lambda keeper: store.begin(_submit("resp_1")))
    assert thread.put_op(_get("resp_1")) is None
    thread.do(lambda keeper: seen.append(thread.has_reply))
    gate.set()
    wait_for(lambda: seen, 10, "the job after the op")
    assert seen == [True]
    answered = thread.take_reply()
    assert answered is not None and answered[1].status == 200
    assert answered[1].response is not None and answered[1].response.status == "in_progress"
    assert thread.close(10)


def test_replies_the_tick_has_not_taken_hold_back_the_ops_not_the_jobs() -> None:
    """Past its bound of replies waiting for the tick, the thread answers no op (the flood
    waits as ops, not as replies in memory), while the engine's jobs go on."""
    thread, store = _thread(reply_bytes=1)
    store.begin(_submit("resp_1"))
    store.complete("resp_1", "some text", Usage(1, 1))
    for i in range(3):
        assert thread.put_op(_get("resp_1", f"op-{i}")) is None
    wait_for(lambda: thread.has_reply, 10, "the first reply")
    done = threading.Event()
    thread.do(lambda keeper: done.set())
    assert done.wait(10)
    assert [op.op_id for op, *_ in thread._replies] == ["op-0"]
    taken = []
    while len(taken) < 3:
        wait_for(lambda: thread.has_reply, 10, "the next reply")
        answered = thread.take_reply()
        assert answered is not None
        taken.append(answered[0].op_id)
    assert taken == ["op-0", "op-1", "op-2"]
    assert thread.close(10)
