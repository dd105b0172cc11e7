"""The daemon's answers to ResponseOps on real FIFOs (a store op's deadline, its size, the turns
ops and forward passes take, a cancel through another replica); the test plays the proxy."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from daemon.responses.store import ResponseStore
from ipc import daemon_side
from ipc.framing import MAX_FRAME_BYTES, encode_control
from ipc.reasons import Reason
from ipc.records import (
    AbortCause,
    Delta,
    Finish,
    Message,
    RequestKind,
    ResponseFields,
    SamplingParams,
    Submit,
    Usage,
)
from ipc.response_records import (
    ConversationCreate,
    ConversationGet,
    ResponseCancel,
    ResponseGet,
    ResponseOp,
    ResponseReply,
    StoreRequest,
)
from tests.daemon.test_server import F_SETPIPE_SZ, completion, daemon, finish_of, hello

__all__ = ["daemon"]  # the fixture, shared with test_server.py


def test_response_op_is_answered(daemon):
    _, proxy, _ = daemon
    hello(proxy)
    proxy.send(ResponseOp("op1", ResponseGet("resp_missing"), 1))
    reply = proxy.wait_for(lambda r: isinstance(r, ResponseReply))
    assert isinstance(reply, ResponseReply) and (reply.op_id, reply.reason) == ("op1", Reason.NOT_FOUND)


def test_a_cancel_through_another_replica_is_applied_at_the_next_tick(daemon, tmp_path: Path):
    server, proxy, _ = daemon
    hello(proxy)
    fields = ResponseFields(store=True, background=True, input=[Message("user", "go")])
    proxy.send(Submit("resp_bg", RequestKind.RESPONSE,
                      SamplingParams(max_tokens=400, ignore_eos=True), response=fields, epoch=1))
    proxy.wait_for(lambda r: isinstance(r, Delta) and r.rid == "resp_bg")
    other = ResponseStore(tmp_path / "store.db", 100, 3600.0, replica_id="other")
    cancel = ResponseOp("op-1", ResponseCancel("resp_bg"), 1)
    assert other.handle_op(cancel, running=False).reason is None
    # The owner's watcher hands the cancel to the tick through a queue; no tick waits on it.
    watcher = server.store.watcher(server.store.db.for_thread())
    assert watcher.poll_cancels() == 1
    learned_at_tick = server.engine.figures.num_ticks
    fin = proxy.wait_for(finish_of("resp_bg"))
    assert isinstance(fin, Finish) and fin.cause is AbortCause.CANCEL
    assert server.engine.figures.num_ticks - learned_at_tick <= 1  # at most the tick in flight
    watcher.db.close()
    other.close()


def test_a_slow_proxy_holds_forward_passes_and_replies_not_the_connection(daemon, monkeypatch):
    """Backlogged (the proxy reads more slowly than we write), the loop runs no forward pass and
    answers no ResponseOp; once the proxy reads, both go on, the replies in order."""
    server, proxy, _ = daemon
    monkeypatch.setattr(daemon_side, "BACKLOG_BOUND_BYTES", 0)  # backlogged once anything waits
    hello(proxy)
    fcntl.fcntl(proxy.tokens, F_SETPIPE_SZ, 4096)  # a pipe that a few ticks fill
    proxy.send(completion("a", max_tokens=490, ignore_eos=True))
    deadline = time.monotonic() + 1.0
    while not server.pipes.backlogged:
        assert time.monotonic() < deadline, "the pipe never filled"
        time.sleep(0.01)
    ticks = server.engine.figures.num_ticks
    proxy.send(ResponseOp("op1", ResponseGet("resp_missing"), 1))
    proxy.send(ResponseOp("op2", ResponseGet("resp_missing"), 1))
    time.sleep(0.3)  # well within the stall bound: reading slowly is not being lost
    assert server.engine.figures.num_ticks == ticks
    replies = [proxy.wait_for(lambda r, op=op: isinstance(r, ResponseReply) and r.op_id == op)
               for op in ("op1", "op2")]
    assert proxy.received.index(replies[0]) < proxy.received.index(replies[1])
    fin = proxy.wait_for(finish_of("a"), timeout=30)
    assert isinstance(fin, Finish) and fin.usage.completion_tokens == 490


def test_a_reply_too_large_for_a_frame_is_an_error_for_its_op_only(daemon, tmp_path: Path):
    _server, proxy, _ = daemon
    hello(proxy)
    # A row no request of this release could store (its instructions outgrow a frame).
    other = ResponseStore(tmp_path / "store.db", 100, 3600.0, replica_id="other")
    fields = ResponseFields(instructions="i" * (MAX_FRAME_BYTES + 1),
                            input=[Message("user", "go")])
    other.begin(Submit("resp_huge", RequestKind.RESPONSE, SamplingParams(), response=fields))
    other.complete("resp_huge", "done", Usage(1, 1))
    other.close()
    proxy.send(ResponseOp("op1", ResponseGet("resp_huge"), 1))
    proxy.send(ResponseOp("op2", ResponseGet("resp_missing"), 1))
    huge = proxy.wait_for(lambda r: isinstance(r, ResponseReply) and r.op_id == "op1")
    assert isinstance(huge, ResponseReply) and huge.reason is Reason.TOO_LARGE
    assert huge.message is not None and "too large" in huge.message
    assert str(MAX_FRAME_BYTES) in huge.message
    missing = proxy.wait_for(lambda r: isinstance(r, ResponseReply) and r.op_id == "op2")
    assert isinstance(missing, ResponseReply) and missing.reason is Reason.NOT_FOUND
    proxy.send(completion("after", max_tokens=3))
    assert isinstance(proxy.wait_for(finish_of("after")), Finish)


MISSING = ResponseGet("resp_missing")


def _op(op_id: str, request: StoreRequest = MISSING, **fields) -> ResponseOp:
    return ResponseOp(op_id, request, 1, **fields)


def test_an_op_past_its_deadline_is_answered_and_not_applied(daemon):
    """The proxy stops waiting at an op's deadline: past it the daemon must not apply the op,
    or a client told 503 finds it applied, and its retry applies it twice."""
    _, proxy, _ = daemon
    hello(proxy)
    late, timely = time.monotonic() - 0.01, time.monotonic() + 30
    proxy.send(_op("late", ConversationCreate("conv_late"), deadline=late))
    proxy.send(_op("timely", ConversationCreate("conv_timely"), deadline=timely))
    for op_id, reason in (("late", Reason.NOT_APPLIED), ("timely", None)):
        reply = proxy.wait_for(lambda r, i=op_id: isinstance(r, ResponseReply) and r.op_id == i)
        assert isinstance(reply, ResponseReply) and reply.reason is reason, reply
    assert "not applied" in (proxy.received[-2].message or "")  # type: ignore[union-attr]
    for cid, reason in (("conv_late", Reason.NOT_FOUND), ("conv_timely", None)):
        proxy.send(_op(f"get-{cid}", ConversationGet(cid)))
        reply = proxy.wait_for(lambda r, c=cid: isinstance(r, ResponseReply)
                               and r.op_id == f"get-{c}")
        assert isinstance(reply, ResponseReply) and reply.reason is reason


def test_slow_ops_never_hold_the_forward_pass_and_clients_take_turns(daemon, monkeypatch):
    """A flood of ops from one client, each costing the store 5 ms: the forward pass does not
    wait for any of them (they are answered on the store thread), and another client's op
    waits for one of the flood's, not for all of them."""
    _, proxy, _ = daemon
    handle_op = ResponseStore.handle_op

    def slow(store: ResponseStore, op: ResponseOp, running: bool) -> ResponseReply:
        time.sleep(0.005)
        return handle_op(store, op, running)

    monkeypatch.setattr(ResponseStore, "handle_op", slow)
    hello(proxy)
    proxy.send(completion("stream", max_tokens=490, ignore_eos=True))
    proxy.wait_for(lambda r: isinstance(r, Delta) and r.rid == "stream")
    ops = [_op(f"flood-{i}", client="flooder") for i in range(30)]
    ops.append(_op("bystander", client="bystander"))
    os.write(proxy.control, b"".join(encode_control(op) for op in ops))  # read all at once
    proxy.wait_for(lambda r: isinstance(r, ResponseReply) and r.op_id == "flood-29")
    replies = [r.op_id for r in proxy.received if isinstance(r, ResponseReply)]
    # After the flood's op the thread took as the first came, one turn of the flood's: never
    # all of them.
    assert replies.index("bystander") <= 2, replies
    first = next(i for i, r in enumerate(proxy.received) if isinstance(r, ResponseReply))
    between = [r for r in proxy.received[first:] if isinstance(r, Delta) and r.rid == "stream"]
    assert len(between) >= 12, f"{len(between)} tokens of the stream while 31 ops were answered"
