"""Prometheus figures: the daemon's last Stats plus what only the proxy can measure.

The daemon's counters are cumulative since it started, so they are exposed as counters straight
from the last Stats record by a collector (a daemon restart reads as a counter reset, which
Prometheus handles) rather than replayed through inc(). While no daemon is connected they keep
the last values it sent (a drop to 0 would read as a reset, and its return as a second one);
its gauges, which would describe a daemon nobody hears from, are left out.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ipc.records import AbortCause, Delta, Finish, FinishReason
from ipc.stats import Phase, Stats
from proxy.engine.client import EngineClient

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Dense up to a few ticks of a slow model: the benchmark judges p99 by these bounds.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04,
                    0.05, 0.06, 0.075, 0.1, 0.15, 0.2, 0.25, 0.5, 1.0, 2.5, 5.0)
_TICK_BUCKETS = (0, 1, 2, 3, 5, 10, 25)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

_GAUGES = (
    ("tether_requests_running", "Sessions the daemon is running", "running"),
    ("tether_requests_waiting", "Sessions queued in the daemon", "waiting"),
    ("tether_kv_cache_blocks_used", "KV cache blocks held by live sessions", "kv_blocks_used"),
    ("tether_kv_cache_blocks_total", "KV cache blocks in the pool", "kv_blocks_total"),
    ("tether_kv_cache_blocks_cached",
     "KV cache blocks held by no session, kept for prefix reuse (free to take)",
     "kv_blocks_cached"),
    ("tether_conversation_placeholders", "Responses placeholders held", "placeholders"),
    ("tether_requests_paused", "Sessions paused because their client is not reading", "paused"),
    ("tether_grammar_cache_bytes", "Compiled structured-output grammars kept for reuse",
     "grammar_cache_bytes"),
    ("tether_grammar_compiles_pending", "Sessions waiting for their grammar's compile",
     "grammar_pending"),
    # The store's, all replicas' together, as last counted (every few seconds, and after a change
    # here).
    ("tether_conversations", "Conversations in the store", "conversations"),
    ("tether_conversation_items", "Items of the conversations in the store",
     "conversation_items"),
)

_TOKEN_COUNTERS = (
    ("tether_prompt_tokens", "Prompt tokens prefilled", "prompt_tokens"),
    ("tether_generation_tokens", "Tokens generated", "generation_tokens"),
    ("tether_tokens_after_disconnect",
     "Tokens generated after the client's disconnect was written", "tokens_after_disconnect"),
    ("tether_engine_ticks", "Forward passes the daemon has run", "ticks"),
    ("tether_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
     "prefix_cache_queries"),
    ("tether_prefix_cache_hits", "Prompt tokens found in the prefix cache", "prefix_cache_hits"),
    ("tether_grammar_compiles", "Structured-output grammars compiled (cache misses)",
     "grammar_compiles"),
    ("tether_grammar_cache_hits", "Structured-output grammars found compiled",
     "grammar_cache_hits"),
    ("tether_spec_decode_num_drafts", "Decodes that verified drafts (speculative decoding)",
     "spec_decode_num_drafts"),
    ("tether_spec_decode_num_draft_tokens", "Draft tokens verified", "spec_decode_num_draft_tokens"),
    ("tether_spec_decode_num_accepted_tokens", "Draft tokens accepted",
     "spec_decode_num_accepted_tokens"),
)


class EngineCollector(Collector):
    """Reads the engine client's last Stats at scrape time."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.last_stats
        yield from self._gauges(stats)
        yield from self._counters(stats)
        yield from self._proxy_figures()

    def _gauges(self, stats: Stats | None) -> Iterator[Metric]:
        if stats is None or not self.engine.up:
            return  # no daemon connected: nothing current to show (tether_daemon_up says 0)
        for name, doc, attr in _GAUGES:
            yield GaugeMetricFamily(name, doc, value=getattr(stats, attr))

    def _counters(self, stats: Stats | None) -> Iterator[Metric]:
        finished = CounterMetricFamily("tether_requests_finished",
                                       "Requests finished in the daemon, by reason",
                                       labels=["reason"])
        for reason in FinishReason:
            finished.add_metric([reason.value], stats.finished.get(reason.value, 0) if stats else 0)
        yield finished
        aborts = CounterMetricFamily("tether_aborts", "Sessions aborted in the daemon, by cause",
                                     labels=["cause"])
        for cause in AbortCause:
            aborts.add_metric([cause.value], stats.aborts.get(cause.value, 0) if stats else 0)
        yield aborts
        for name, doc, attr in _TOKEN_COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(stats, attr) if stats else 0)
        phases = CounterMetricFamily("tether_engine_phase_seconds",
                                     "Time the engine's steps spent in each phase",
                                     labels=["phase"])
        for phase in Phase:
            phases.add_metric([phase.value], stats.phase_seconds.get(phase.value, 0.0)
                              if stats else 0.0)
        yield phases
        bad = CounterMetricFamily("tether_ipc_bad_records", "Undecodable IPC records, by pipe",
                                  labels=["pipe"])
        counts = dict(stats.bad_records) if stats else {}
        counts["tokens"] = counts.get("tokens", 0) + self.engine.bad_records
        for pipe in ("requests", "control", *sorted(set(counts) - {"requests", "control"})):
            bad.add_metric([pipe], counts.get(pipe, 0))
        yield bad

    def _proxy_figures(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("tether_proxy_sessions", "Sessions open in the proxy",
                                value=self.engine.num_sessions)
        yield GaugeMetricFamily("tether_proxy_sessions_waiting",
                                "Sessions the daemon has not answered yet",
                                value=self.engine.num_waiting)
        yield GaugeMetricFamily("tether_daemon_up", "1 when the daemon answers",
                                value=1 if self.engine.up else 0)
        sent = CounterMetricFamily("tether_proxy_aborts_sent", "Abort records written, by cause",
                                   labels=["cause"])
        for cause, count in self.engine.aborts_sent.items():
            sent.add_metric([cause.value], count)
        yield sent


class ProxyMetrics:
    """One private registry per app, so tests can build several apps in one process."""

    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine))
        self.abort_latency = Histogram(
            "tether_abort_latency_seconds",
            "From the proxy seeing a disconnect to the daemon evicting the session",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.abort_latency_ticks = Histogram(
            "tether_abort_latency_ticks",
            "Forward passes that started between the disconnect and the eviction",
            buckets=_TICK_BUCKETS, registry=self.registry)
        self.grammar_compile = Histogram(
            "tether_grammar_compile_seconds", "Time to compile a structured-output grammar",
            buckets=_COMPILE_BUCKETS, registry=self.registry)
        self.time_to_first_token = Histogram(
            "tether_time_to_first_token_seconds", "From request arrival to the first token",
            buckets=_TTFT_BUCKETS, registry=self.registry)
        self.request_duration = Histogram(
            "tether_request_duration_seconds", "From request arrival to its last byte",
            labelnames=["endpoint"], buckets=_DURATION_BUCKETS, registry=self.registry)
        # Counted by the access log middleware as each answer ends (proxy/access_log.py).
        self.http_requests = Counter(
            "tether_http_requests",
            "HTTP requests by route template and status (none: the client left before any "
            "answer)", labelnames=["route", "status"], registry=self.registry)
        engine.stats_listeners.append(self._on_stats)

    def _on_stats(self, stats: Stats) -> None:
        for seconds in stats.abort_latency_obs:
            self.abort_latency.observe(seconds)
        for ticks in stats.abort_latency_ticks_obs:
            self.abort_latency_ticks.observe(ticks)
        for seconds in stats.grammar_compile_obs:
            self.grammar_compile.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One request's time to first token and duration, into the proxy's histograms."""

    __slots__ = ("_endpoint", "_first_seen", "_metrics", "_t_start")

    def __init__(self, metrics: ProxyMetrics, endpoint: str, t_start: float) -> None:
        self._metrics = metrics
        self._endpoint = endpoint
        self._t_start = t_start
        self._first_seen = False

    def see(self, batch: list[Delta | Finish]) -> None:
        """A batch of the request's records is being handed on; the first with a token stops
        the time to first token."""
        if not self._first_seen:
            for record in batch:
                if type(record) is Delta:
                    self._first_seen = True
                    self._metrics.time_to_first_token.observe(time.monotonic() - self._t_start)
                    return

    def done(self) -> None:
        self._metrics.request_duration.labels(self._endpoint).observe(
            time.monotonic() - self._t_start)
