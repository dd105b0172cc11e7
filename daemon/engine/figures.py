"""What the engine counts and logs about its requests: the counters behind /metrics, the abort
latencies (in seconds and in ticks) since the last Stats, and one log line per request's end.

Kept apart from the engine so that its tick reads as scheduling and sampling only; the engine
tells this at a few points (a tick started, a request was refused, one ended) and asks it for
Stats.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, NamedTuple

from daemon.engine.session import Session
from ipc.records import AbortCause, FinishReason, Submit
from ipc.stats import Phase, Stats

request_log = logging.getLogger("tether.requests")

# Tick start times kept for tests and for abort latency in ticks.
TICK_LOG_SIZE = 4096
# An aborted request's log line carries its newest ticks: enough to show any tick that started
# after the client left, and one from before.
LOGGED_TICKS = 4


class TickRecord(NamedTuple):  # a tuple: made every tick, it costs a frozen dataclass's third
    tick: int
    start: float
    rids: frozenset[str]


class Figures:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.tick_log: deque[TickRecord] = deque(maxlen=TICK_LOG_SIZE)
        self.num_ticks = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_tokens_after_disconnect = 0
        self.aborts: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()
        self._latency_obs: list[float] = []
        self._latency_ticks_obs: list[int] = []
        # Seconds spent in each phase of a step, summed over the steps.
        self.phase_seconds = [0.0] * len(Phase)  # in Phase order

    def timed(self, laps: list[float]) -> None:
        """A step's phases took the times between `laps` (perf_counter when it started, then
        when each phase ended, in Phase order). Wall time, not the engine's clock: a phase's
        cost is a measurement, not a stamp anyone compares."""
        seconds = self.phase_seconds
        for i in range(len(seconds)):
            seconds[i] += laps[i + 1] - laps[i]

    def tick(self, start: float, rids: frozenset[str], prefill_tokens: int) -> None:
        self.num_ticks += 1
        self.tick_log.append(TickRecord(self.num_ticks, start, rids))
        self.num_prompt_tokens += prefill_tokens

    def _ticks_since(self, t: float) -> int:
        return sum(1 for r in self.tick_log if r.start > t)

    def _latency(self, t_disconnect: float, now: float) -> float:
        latency = now - t_disconnect
        self._latency_obs.append(latency)
        self._latency_ticks_obs.append(self._ticks_since(t_disconnect))
        return latency

    def refused(self, rec: Submit, cause: AbortCause, t_disconnect: float | None) -> None:
        """A request ended before it was admitted (aborted while still in the pipe, or sent
        under a stale epoch): counted and logged like any other abort."""
        self.aborts[cause.value] += 1
        self.finished[FinishReason.ABORT.value] += 1
        fields: dict[str, Any] = {"rid": rec.rid, "kind": rec.kind.value, "n": rec.n,
                                  "finish_reason": FinishReason.ABORT.value,
                                  "cause": cause.value, "admitted": False}
        if rec.client_id is not None:
            fields["client_id"] = rec.client_id
        if t_disconnect is not None:
            fields["abort_latency_s"] = round(self._latency(t_disconnect, self.clock()), 6)
        request_log.info("request %s abort", rec.rid, extra={"fields": fields})

    def evicted(self, session: Session, reason: FinishReason, cause: AbortCause | None,
                t_read: float | None) -> None:
        """A session ended by an abort (`cause`) or a failure (None)."""
        now = self.clock()
        self.finished[reason.value] += 1
        extra: dict[str, Any] = {}
        if cause is not None:
            self.aborts[cause.value] += 1
            # Monotonic stamps (CLOCK_MONOTONIC is system-wide): a client can set its own
            # close time against them, and count the tokens sampled after it.
            extra = {"evicted_at": round(now, 6),
                     "last_ticks": [[round(t, 6), n] for t, n in session.ticks.tail(LOGGED_TICKS)]}
        if session.t_disconnect is not None:
            t = session.t_disconnect
            ticks, tokens = session.tokens_after(t)
            self.num_tokens_after_disconnect += tokens
            extra |= {"abort_latency_s": round(self._latency(t, now), 6),
                      "ticks_after_disconnect": ticks, "tokens_after_disconnect": tokens}
            if t_read is not None:
                extra["abort_read_s"] = round(t_read - t, 6)
        self._log_end(session, reason, cause, extra)

    def completed(self, session: Session, reason: FinishReason, error: str | None) -> None:
        """A session whose every sequence finished; counted per request, like the aborts (its
        reason is its last sequence's)."""
        self.finished[reason.value] += 1
        self._log_end(session, reason, None, {} if error is None else {"error": error})

    def stats(self, **gauges: Any) -> Stats:
        """Stats with the counters now and the latency observations since the last call."""
        obs, self._latency_obs = self._latency_obs, []
        ticks_obs, self._latency_ticks_obs = self._latency_ticks_obs, []
        return Stats(t=self.clock(), ticks=self.num_ticks, prompt_tokens=self.num_prompt_tokens,
                     generation_tokens=self.num_generation_tokens,
                     tokens_after_disconnect=self.num_tokens_after_disconnect,
                     aborts=dict(self.aborts), finished=dict(self.finished), bad_records={},
                     abort_latency_obs=obs, abort_latency_ticks_obs=ticks_obs,
                     phase_seconds=dict(zip(Phase, self.phase_seconds, strict=True)), **gauges)

    def _log_end(self, session: Session, reason: FinishReason, cause: AbortCause | None,
                 extra: dict[str, Any]) -> None:
        reasons = sorted({s.finish_reason.value for s in session.sequences if s.finish_reason})
        fields = {
            "rid": session.rid, "kind": session.kind.value, "n": len(session.sequences),
            "finish_reason": ",".join(reasons) or reason.value,
            "cause": cause.value if cause is not None else None,
            "prompt_tokens": session.num_prompt_tokens,
            "generated_tokens": session.num_generated,
            "duration_s": round(self.clock() - session.t_arrival, 6), **extra,
        }
        if session.client_id is not None:
            fields["client_id"] = session.client_id
        request_log.info("request %s %s", session.rid, fields["finish_reason"],
                         extra={"fields": fields})
