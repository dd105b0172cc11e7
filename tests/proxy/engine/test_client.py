from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import tracemalloc
from collections.abc import AsyncIterator

import pytest

from ipc.reasons import Reason
from ipc.records import AbortCause, Finish, RequestKind, SamplingParams, Submit
from ipc.response_records import ResponseGet
from proxy.engine import client as engine_client
from proxy.engine.client import EngineClient
from proxy.http.errors import ApiError
from proxy.options import ProxyOptions
from tests.support.peer import Peer
from tests.support.wait import wait_until

pytestmark = pytest.mark.anyio


@pytest.fixture
async def engine(options: ProxyOptions, peer: Peer) -> AsyncIterator[EngineClient]:
    client = EngineClient(options.runtime_dir, options.max_waiting)
    await client.start()
    await wait_until(lambda: client.up)
    yield client
    await client.close()


async def barrier(engine: EngineClient) -> None:
    """The peer answers a ResponseOp only after reading every control record written before it."""
    assert (await engine.response_op(ResponseGet("resp_barrier"))).reason is Reason.NOT_FOUND


def submit(rid: str, max_tokens: int = 3, prompts: int = 1, n: int = 1) -> Submit:
    return Submit(rid=rid, kind=RequestKind.COMPLETION,
                  sampling=SamplingParams(max_tokens=max_tokens),
                  prompts=[f"p{i}" for i in range(prompts)], n=n)


async def test_welcome_is_tracked(engine: EngineClient) -> None:
    assert engine.model == "test-model" and engine.max_model_len == 4096
    await wait_until(lambda: engine.last_stats is not None)


async def test_full_session_writes_no_abort(engine: EngineClient, peer: Peer) -> None:
    records = [r async for batch in engine.generate(submit("full", prompts=2, n=2))
               for r in batch]
    finishes = [r for r in records if isinstance(r, Finish)]
    assert sorted(f.index for f in finishes) == [0, 1, 2, 3]
    assert isinstance(records[-1], Finish)
    # Stopping right after the last Finish (and closing, as the SSE response does) is still a
    # normal end.
    async with contextlib.aclosing(engine.generate(submit("brk", max_tokens=1))) as stream:
        async for batch in stream:
            if isinstance(batch[-1], Finish):
                break
    await barrier(engine)
    assert peer.aborts == [] and engine.num_sessions == 0


async def test_closing_early_writes_the_abort_at_once(engine: EngineClient, peer: Peer) -> None:
    stream = engine.generate(submit("early", max_tokens=4000))
    await anext(stream)
    await stream.aclose()
    assert engine.aborts_sent[AbortCause.CLIENT_DISCONNECT] == 1
    peer.wait_for(lambda p: [a.rid for a in p.aborts] == ["early"])
    assert peer.aborts[0].cause is AbortCause.CLIENT_DISCONNECT


async def test_cancelling_a_queued_session_writes_the_abort(engine: EngineClient,
                                                            peer: Peer) -> None:
    peer.hold = True
    stream = engine.generate(submit("queued"))
    task = asyncio.ensure_future(anext(stream))
    await wait_until(lambda: engine.num_waiting == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.num_waiting == 0 and engine.num_sessions == 0
    peer.wait_for(lambda p: [a.rid for a in p.aborts] == ["queued"])


async def test_abort_on_exit_false_leaves_the_session_running(engine: EngineClient,
                                                              peer: Peer) -> None:
    stream = engine.generate(submit("bg", max_tokens=50), abort_on_exit=False)
    await anext(stream)
    await stream.aclose()
    await barrier(engine)
    assert peer.aborts == []


async def test_rejection_raises_its_error_without_abort(engine: EngineClient,
                                                        peer: Peer) -> None:
    bad = Submit(rid="long", kind=RequestKind.COMPLETION,
                 sampling=SamplingParams(), prompts=["TOO LONG"])
    with pytest.raises(ApiError) as info:
        async for _ in engine.generate(bad):
            pass
    assert (info.value.status, info.value.param) == (400, "prompt")
    await barrier(engine)
    assert peer.aborts == []


async def test_daemon_lost_fails_every_session(engine: EngineClient, peer: Peer) -> None:
    streams = [engine.generate(submit(f"lost{i}", max_tokens=4000)) for i in range(3)]
    for stream in streams:
        await anext(stream)
    peer.stop()
    for stream in streams:
        with pytest.raises(ApiError) as info:
            async for _ in stream:
                pass
        assert info.value.status == 503
    assert not engine.up and engine.num_sessions == 0
    with pytest.raises(ApiError):
        await anext(engine.generate(submit("after")))


async def test_duplicate_rid_is_refused(engine: EngineClient, peer: Peer) -> None:
    peer.hold = True
    first = engine.generate(submit("same"))
    task = asyncio.ensure_future(anext(first))
    await wait_until(lambda: engine.num_sessions == 1)
    with pytest.raises(ApiError) as info:
        await anext(engine.generate(submit("same")))
    assert info.value.code == "duplicate_request_id"
    peer.hold = False
    await task
    await first.aclose()


async def test_an_op_is_answered_as_the_daemon_answers_it_even_past_its_deadline(
        engine: EngineClient, peer: Peer) -> None:
    """The daemon applies an op only before its deadline and answers it either way: the proxy
    waits for that answer rather than say 503 while the op may yet be applied."""
    peer.answer_ops = False
    asked = time.monotonic()
    op = asyncio.ensure_future(engine.response_op(ResponseGet("resp_x"), timeout=0.1))
    await wait_until(lambda: peer.held_ops)
    deadline = peer.held_ops[0].deadline
    assert deadline is not None and asked + 0.1 <= deadline <= time.monotonic() + 0.1
    await asyncio.sleep(0.3)  # past the deadline
    assert not op.done()
    peer.answer_ops = True
    assert (await op).reason is Reason.NOT_FOUND


async def test_an_op_never_answered_is_503_saying_it_may_have_been_applied(
        engine: EngineClient, peer: Peer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_client, "REPLY_GRACE_S", 0.2)
    peer.answer_ops = False
    with pytest.raises(ApiError) as info:
        await engine.response_op(ResponseGet("resp_x"), timeout=0.1)
    assert info.value.status == 503 and "may or may not" in info.value.message


async def test_held_streams_are_cheap(engine: EngineClient, peer: Peer) -> None:
    peer.hold = True
    count = 1000
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    streams = [engine.generate(submit(f"held{i}")) for i in range(count)]
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    await wait_until(lambda: engine.num_waiting == count, timeout=20)
    per_stream = (tracemalloc.get_traced_memory()[0] - base) / count
    tracemalloc.stop()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    print(f"{per_stream:.0f} bytes per held stream")
    assert per_stream <= 20_000, per_stream
    peer.wait_for(lambda p: len(p.aborts) == count, timeout=20)


async def test_a_request_the_daemon_never_takes_times_out(options: ProxyOptions,
                                                          peer: Peer) -> None:
    client = EngineClient(options.runtime_dir, options.max_waiting, request_timeout=0.5)
    await client.start()
    try:
        await wait_until(lambda: client.up)
        peer.hold = True  # the test daemon reads the Submit and never answers it
        with pytest.raises(ApiError) as info:
            await anext(client.generate(submit("late")))
        assert (info.value.status, info.value.code) == (504, "timeout")
        peer.wait_for(lambda p: [(a.rid, a.cause) for a in p.aborts]
                      == [("late", AbortCause.TIMEOUT)])
        assert client.aborts_sent[AbortCause.TIMEOUT] == 1 and client.num_sessions == 0
    finally:
        await client.close()


async def test_a_reader_that_stops_pauses_the_session_then_stalls_it(options: ProxyOptions,
                                                                      peer: Peer) -> None:
    client = EngineClient(options.runtime_dir, options.max_waiting, stall_timeout=1.5,
                          max_buffered=8)
    await client.start()
    try:
        await wait_until(lambda: client.up)
        stream = client.generate(submit("slow", max_tokens=4000, prompts=2))
        await anext(stream)
        # Not reading: the proxy holds more than 8 tokens, and the daemon is told to pause.
        await wait_until(lambda: [type(r).__name__ for r in peer.flow] == ["Pause"])
        deadline = time.monotonic() + 10
        while len(peer.flow) < 2:  # reading again: below half the mark, it resumes
            assert time.monotonic() < deadline, "no Resume"
            await anext(stream)
            await asyncio.sleep(0.001)
        assert [type(r).__name__ for r in peer.flow[:2]] == ["Pause", "Resume"]
        # Not reading at all for the stall timeout: aborted with cause timeout.
        await wait_until(lambda: any(a.cause is AbortCause.TIMEOUT for a in peer.aborts), 10)
        with pytest.raises(ApiError) as info:
            while True:
                await anext(stream)
        assert info.value.code == "timeout"
        await stream.aclose()
        assert [a.rid for a in peer.aborts] == ["slow"]  # no second abort on close
    finally:
        await client.close()
