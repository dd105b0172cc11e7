"""A process that hangs alive is caught by silence, on the real pair.

SIGSTOP leaves a process's pipe ends open, so its peer sees no EOF: only the silence bound can
catch it. The bound and the intervals below are the documented figures (docs/architecture.md,
Liveness), not the code's constants, so a change to either shows here. The intervals are read
off the frames each process wrote while its peer was stopped: each frame carries its writer's
own clock.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipc.pipes import CONTROL, TOKENS, Loss, ProxyConnection
from ipc.records import Delta, Finish, FinishReason, Heartbeat, RequestKind, SamplingParams, Submit
from ipc.stats import Stats
from ipc.wire import ToProxy
from tests.support.metrics import m
from tests.support.pair import (
    LONG,
    Server,
    assert_baseline,
    new_rid,
    post_raw,
    start_server,
    wait_aborts,
)
from tests.support.raw_http import read_events, read_to_end
from tests.support.wait import free_port, wait_for

pytestmark = pytest.mark.timeout(120)

SILENCE_S = 3.0  # docs/architecture.md: "3 s of silence counts as lost"
HEARTBEAT_S = 0.25  # docs/architecture.md: "the proxy heartbeats every 250 ms"
STATS_S = 0.1  # docs/architecture.md: "the daemon sends Stats every 100 ms"
# How late a lost peer may be declared on a busy machine; being early is never allowed.
LATE_S = 1.5
# Frames written while the peer is stopped; read well before it would be declared lost.
SAMPLE_S = 1.2


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """sim:10 (the real engine on a weightless runner, 10 ms a tick): a stream of LONG's 1,500
    tokens outlasts the silence bound however fast a real model decodes."""
    s = start_server(tmp_path_factory.mktemp("silence"), ["--max-num-seqs", "4", "--model", "sim:10"])
    yield s
    s.stop()


def new_messages(server: Server, which: str, mark: int, prefix: str) -> list[str]:
    return [x["msg"] for x in server.log_lines(which)[mark:] if x["msg"].startswith(prefix)]


def log_marks(server: Server) -> dict[str, int]:
    return {which: len(server.log_lines(which)) for which in ("daemon", "proxy")}


def long_stream(server: Server, prefix: str) -> tuple[str, socket.socket]:
    """A stream that outlasts the silence bound, with its first events read."""
    rid = new_rid(prefix)
    sock = post_raw(server, "/v1/completions", {"prompt": "go on", "stream": True, **LONG}, rid)
    read_events(sock, 3)
    return rid, sock


def check_intervals(stamps: list[float], every: float) -> None:
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    assert len(gaps) >= SAMPLE_S / every / 2, stamps
    assert every <= statistics.median(gaps) <= every * 1.3, gaps
    assert max(gaps) < SILENCE_S / 2, gaps  # far from being taken for silence


def test_an_idle_healthy_pair_stays_connected_for_twice_the_bound(pair: Server) -> None:
    marks = log_marks(pair)
    start = time.monotonic()
    while time.monotonic() - start < 2 * SILENCE_S + 0.5:
        assert pair.health() == 200
        time.sleep(0.1)
    for which, mark in marks.items():
        assert not [x for x in pair.log_lines(which)[mark:] if "lost" in x["msg"]], which
    assert m(pair.metrics(), "tether_daemon_up") == 1


def test_a_hung_daemon_is_lost_after_the_bound_and_its_epoch_evicted(pair: Server) -> None:
    before, marks = pair.metrics(), log_marks(pair)
    rid, sock = long_stream(pair, "hung-daemon")
    sock.settimeout(SILENCE_S + LATE_S + 5)
    stopped_at = pair.signal("daemon", signal.SIGSTOP)
    try:
        time.sleep(SAMPLE_S)
        beats = [r.t for r in pair.take_frames(CONTROL) if isinstance(r, Heartbeat)]
        rest = read_to_end(sock)
        silent_for = time.monotonic() - stopped_at
        assert SILENCE_S - 0.1 <= silent_for <= SILENCE_S + LATE_S, silent_for
        assert b'"error"' in rest.split(b"data: ")[-1], rest[-300:]
        assert new_messages(pair, "proxy", marks["proxy"], "ipc: daemon lost: ") == [
            f"ipc: daemon lost: no record from the daemon for {SILENCE_S:g} s"]
        assert pair.health() == 503
        # Resumed once the proxy has reopened its pipe ends, the daemon sees no EOF (nor
        # silence: records are waiting); only the new epoch in the proxy's Hello tells it.
        wait_for(lambda: new_messages(pair, "proxy", marks["proxy"], "ipc: pipes open"), 10,
                 "the proxy reconnects")
    finally:
        pair.signal("daemon", signal.SIGCONT)
        sock.close()
    check_intervals(beats, HEARTBEAT_S)
    pair.wait_health(200)
    line = pair.request_line(rid)
    assert line["cause"] == "proxy_lost", line
    assert new_messages(pair, "daemon", marks["daemon"], "proxy lost (") == []
    assert new_messages(pair, "daemon", marks["daemon"], "proxy pid ")  # "... connected: epoch N"
    after = wait_aborts(pair, "proxy_lost", m(before, "tether_aborts_total", cause="proxy_lost") + 1)
    assert_baseline(after)


def test_a_hung_proxy_is_lost_after_the_bound(pair: Server) -> None:
    before, marks = pair.metrics(), log_marks(pair)
    rid, sock = long_stream(pair, "hung-proxy")
    sock.settimeout(30)
    stopped_at = pair.signal("proxy", signal.SIGSTOP)
    try:
        time.sleep(SAMPLE_S)
        stats = [r.t for r in pair.take_frames(TOKENS) if isinstance(r, Stats)]
        line = pair.request_line(rid, timeout=SILENCE_S + LATE_S + 5)
        assert line["cause"] == "proxy_lost", line
        # Its last heartbeat came at most one interval before the stop.
        silent_for = line["evicted_at"] - stopped_at
        assert SILENCE_S - HEARTBEAT_S - 0.1 <= silent_for <= SILENCE_S + LATE_S, silent_for
        assert new_messages(pair, "daemon", marks["daemon"], "proxy lost (") == [
            f"proxy lost (no heartbeat from the proxy for {SILENCE_S:g} s); aborting its requests"]
    finally:
        pair.signal("proxy", signal.SIGCONT)
    check_intervals(stats, STATS_S)
    assert b'"error"' in read_to_end(sock).split(b"data: ")[-1]
    sock.close()
    pair.wait_health(200)
    after = wait_aborts(pair, "proxy_lost", m(before, "tether_aborts_total", cause="proxy_lost") + 1)
    assert_baseline(after)


async def _block_the_loop_beside_a_stream(run: Path, blocked_s: float) -> list[ToProxy]:
    """A proxy connection on this loop: one stream under way, then the loop blocked for
    `blocked_s` (a callback that never yields); the stream's records to its end."""
    states: asyncio.Queue[Loss | None] = asyncio.Queue()
    records: list[ToProxy] = []
    connection = ProxyConnection(run, records.append, states.put_nowait)
    await connection.start()
    try:
        assert await asyncio.wait_for(states.get(), 60) is None  # welcomed
        await connection.submit(Submit(
            rid="blocked", kind=RequestKind.COMPLETION, prompts=["go on"],
            sampling=SamplingParams(max_tokens=600, ignore_eos=True, temperature=0)))
        deadline = time.monotonic() + 30
        while not any(isinstance(r, Delta) for r in records):
            assert time.monotonic() < deadline, "the stream never started"
            await asyncio.sleep(0.01)
        time.sleep(blocked_s)  # noqa: ASYNC251 -- the point: the whole event loop stands still
        while not any(isinstance(r, Finish) for r in records):
            assert states.empty(), f"the connection was lost: {states.get_nowait()}"
            assert time.monotonic() < deadline, "the stream never finished"
            await asyncio.sleep(0.01)
        assert states.empty(), f"the connection was lost: {states.get_nowait()}"
    finally:
        await connection.close()
    return records


def test_a_proxy_whose_loop_is_blocked_past_the_bound_is_not_lost(tmp_path: Path) -> None:
    """The proxy heartbeats from a thread of its own, as the daemon's keepalive thread speaks for
    a long forward pass: an event loop busy for longer than the silence bound is not silence."""
    daemon = Server(tmp_path, free_port(), ["--model", "sim:10"])
    daemon.start_daemon()
    try:
        records = asyncio.run(_block_the_loop_beside_a_stream(tmp_path / "run", SILENCE_S + 1))
        [finish] = [r for r in records if isinstance(r, Finish)]
        assert finish.reason is FinishReason.LENGTH and finish.usage.completion_tokens == 600
        # Nothing lost: the connection ends with its own Goodbye, and the EOF of its close
        # (read with the Goodbye or after it) is a close, not a loss. The pipe reader logs the
        # EOF as it reads it; the Goodbye is logged when the loop handles it, maybe just after.
        wait_for(lambda: all(line in daemon.log("daemon") for line in (
            "closed its pipes after its goodbye", "said goodbye")), 30,
            lambda: daemon.log("daemon"))
        assert "proxy lost" not in daemon.log("daemon")
    finally:
        daemon.stop()
