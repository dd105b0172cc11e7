"""Engine figures for /metrics, sent by the daemon on the tokens pipe with every heartbeat."""

from __future__ import annotations

import enum

import msgspec

from ipc.records import Kind


class Phase(enum.StrEnum):
    """The phases of an engine step, in order (daemon/engine/core.py)."""

    SCHEDULE = "schedule"  # the scheduler's batch
    EXECUTE = "execute"  # the forward pass and sampling
    UPDATE = "update"  # the bookkeeping the sampled ids call for
    EMIT = "emit"  # text, stop strings, records


class Stats(msgspec.Struct, tag=Kind.STATS.value, tag_field="k"):
    """Engine figures for /metrics: gauges are current, counters cumulative since start,
    ``*_obs`` lists are observations since the previous Stats record."""

    t: float
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    placeholders: int
    ticks: int
    prompt_tokens: int
    generation_tokens: int
    tokens_after_disconnect: int
    aborts: dict[str, int]
    finished: dict[str, int]
    bad_records: dict[str, int]
    abort_latency_obs: list[float] = []
    abort_latency_ticks_obs: list[int] = []
    kv_blocks_cached: int = 0  # held by no session, kept for the prefix cache (free to take)
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # tokens found there
    paused: int = 0  # requests the proxy has paused (flow control)
    grammar_compiles: int = 0  # grammars compiled (cache misses)
    grammar_cache_hits: int = 0
    grammar_cache_bytes: int = 0
    grammar_pending: int = 0  # sessions waiting for their grammar's compile
    grammar_compile_obs: list[float] = []  # seconds per compile since the previous Stats
    conversations: int = 0  # in the store (all replicas'), as last counted
    conversation_items: int = 0
    # Seconds the engine's steps spent in each phase (a Phase's value), cumulative.
    phase_seconds: dict[str, float] = {}
    # Speculative decoding (vLLM's spec_decode_* names): decodes that verified drafts, their
    # draft tokens, and those accepted. Mean acceptance length: 1 + accepted / drafts.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
