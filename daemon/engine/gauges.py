"""The engine's Stats (ipc/stats.py): the gauges read now from the parts that hold them, with
the counters and latency observations that Figures (figures.py) gathered since the last call."""

from __future__ import annotations

from daemon.engine.figures import Figures
from daemon.engine.guided import Guidance
from daemon.engine.scheduler import Scheduler
from daemon.engine.session import Session
from daemon.engine.stored import StoredTurns
from daemon.responses.lifecycle import Responses
from ipc.stats import Stats


def engine_stats(figures: Figures, scheduler: Scheduler, sessions: dict[str, Session],
                 responses: Responses | None, guidance: Guidance | None,
                 stored: StoredTurns | None) -> Stats:
    # Requests, not sequences: a request runs while any of its sequences does.
    running = len({seq.rid for seq in scheduler.running})
    bm = scheduler.block_manager
    # Placeholders counted here: the store thread learns of an end after the tick that applied it.
    storing = stored.num_storing if stored is not None else 0
    stats = figures.stats(
        running=running, waiting=len(sessions) - running,
        kv_blocks_used=bm.num_used, kv_blocks_total=bm.num_total,
        kv_blocks_cached=bm.num_cached_free,
        prefix_cache_queries=scheduler.num_cache_queries,
        prefix_cache_hits=scheduler.num_cache_hits,
        placeholders=storing + sum(1 for s in sessions.values() if s.placeholder),
        paused=sum(1 for s in sessions.values() if s.paused))
    if responses is not None:
        stats.conversations, stats.conversation_items = responses.conversation_counts()
    if guidance is not None:
        grammars = guidance.grammars
        stats.grammar_compiles, stats.grammar_cache_hits = grammars.num_misses, grammars.num_hits
        stats.grammar_cache_bytes = grammars.num_cached_bytes
        stats.grammar_pending = guidance.num_pending
        stats.grammar_compile_obs = grammars.take_compile_obs()
    return stats
