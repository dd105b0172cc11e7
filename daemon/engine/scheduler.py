"""Continuous batching: which sequences, and which of their tokens, go into the next forward pass.

One tick mixes decodes (one token per running sequence, scheduled first so latency stays flat)
with prefill chunks (chunked prefill under a token budget). The scheduler alone owns the block
manager. When blocks run out a running sequence that is not yet in this tick's batch is
preempted (paused ones first, then newest first) and later recomputed from its tokens.
A paused sequence (its client is not reading: flow control) keeps its place and its blocks but
is never scheduled until resumed.

Prefix caching happens at admission: a waiting sequence starts from the longest run of its full
blocks found in the cache (a preempted one often finds its own), and every block that a forward
pass fills is registered after that pass. The last token is always computed: its logits are
the point of the pass.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from daemon.engine.block_manager import BlockManager, chain_hashes
from daemon.engine.sequence import SeqStatus, Sequence
from daemon.model.batch import ScheduledChunk


@dataclass(slots=True)
class Batch:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)  # seqs[i] owns chunks[i]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    def __bool__(self) -> bool:
        return bool(self.chunks)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        start = seq.num_computed
        end = start + num_tokens
        self.chunks.append(ScheduledChunk(seq.token_ids[start:end], start, seq.block_table,
                                          end == seq.num_tokens))
        self.seqs.append(seq)
        # A decode feeds back one sampled token; one token of a prompt (the rest cached,
        # or a chunk's tail) is still prefill.
        if num_tokens == 1 and start >= seq.num_prompt_tokens:
            self.num_decode_tokens += 1
        else:
            self.num_prefill_tokens += num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_tokens_per_tick: int,
                 copy_block: Callable[[int, int], None]) -> None:
        if max_tokens_per_tick < max_num_seqs:
            # Otherwise some running sequences could not decode in a tick and would starve.
            raise ValueError(f"max_tokens_per_tick ({max_tokens_per_tick}) must be >= "
                             f"max_num_seqs ({max_num_seqs})")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_tokens_per_tick = max_tokens_per_tick
        self.copy_block = copy_block
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Prefix-cache lookups, in tokens (vLLM's queries/hits): every admission counts.
        self.num_cache_queries = 0
        self.num_cache_hits = 0
        self.num_paused = 0  # paused sequences in waiting or running
        # Blocks promised to this tick's forks (taken in postprocess, after the forward pass).
        self._fork_reserve = 0

    @property
    def has_work(self) -> bool:
        """Anything schedulable: paused sequences alone are no work."""
        return len(self.waiting) + len(self.running) > self.num_paused

    @property
    def num_slots_used(self) -> int:
        return sum(1 + len(s.fork_children) for s in self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; its `fork_children` join it once its prompt is prefilled."""
        seq.status = SeqStatus.WAITING
        for child in seq.fork_children:
            child.status = SeqStatus.FORK_PENDING
        self.waiting.append(seq)

    def set_paused(self, seqs: list[Sequence], paused: bool) -> None:
        for seq in seqs:
            if seq.paused == paused:
                continue
            seq.paused = paused
            if seq.status is SeqStatus.WAITING or seq.status is SeqStatus.RUNNING:
                self.num_paused += 1 if paused else -1

    # --- one tick -------------------------------------------------------------------------------

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.max_tokens_per_tick
        self._fork_reserve = 0
        scheduled: set[int] = set()
        for decode_phase in (True, False):
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.status is not SeqStatus.RUNNING or seq.seq_id in scheduled or seq.paused:
                    continue
                if (seq.num_uncomputed == 1) != decode_phase:
                    continue
                n = min(seq.num_uncomputed, budget)
                if self._reserve(seq, n, scheduled):
                    self._add(batch, seq, n)
                    scheduled.add(seq.seq_id)
                    budget -= n
        self._admit(batch, budget)
        return batch

    def _admit(self, batch: Batch, budget: int) -> None:
        bm = self.block_manager
        skipped = 0  # paused sequences at the head wait without holding up the others
        while len(self.waiting) > skipped and budget > 0:
            seq = self.waiting[skipped]
            if seq.paused:
                skipped += 1
                continue
            if self.num_slots_used + 1 + len(seq.fork_children) > self.max_num_seqs:
                return
            hits = self._cache_hits(seq)
            cached = len(hits) * bm.block_size
            n = min(seq.num_tokens - cached, budget)
            end = cached + n
            need = (bm.num_blocks_for(end) - len(hits) + bm.num_revived(hits)
                    + self._fork_cost(seq, end))
            if need > self._num_available:
                return
            del self.waiting[skipped]
            bm.share(seq.block_table, hits)
            seq.num_computed = cached
            self._count_lookup(seq, cached)
            bm.may_append(seq.block_table, end)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._add(batch, seq, n)
            budget -= n

    def _cache_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks for the start of a sequence that holds none yet."""
        bm = self.block_manager
        if not bm.enable_caching:
            return []
        num_blocks = (seq.num_tokens - 1) // bm.block_size  # never the last token's block
        hashes = chain_hashes(seq.token_ids, seq.block_hashes, bm.block_size, num_blocks)
        return bm.lookup(hashes[:num_blocks])

    def _count_lookup(self, seq: Sequence, cached: int) -> None:
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = cached
        if self.block_manager.enable_caching:
            self.num_cache_queries += seq.num_tokens
            self.num_cache_hits += cached

    def _reserve(self, seq: Sequence, n: int, scheduled: set[int]) -> bool:
        """Blocks for `n` more tokens of a running sequence, preempting newer ones if needed."""
        while self._blocks_needed(seq, n) > self._num_available:
            candidates = [v for v in reversed(self.running)
                          if v is not seq and v.seq_id not in scheduled]
            victim = next((v for v in candidates if v.paused), None) or next(iter(candidates),
                                                                              None)
            if victim is None:
                if seq.num_uncomputed == 1:
                    self._preempt(seq)
                # A prefill keeps its blocks and waits for decodes to finish.
                return False
            self._preempt(victim)
        self.block_manager.may_append(seq.block_table, seq.num_computed + n)
        return True

    @property
    def _num_available(self) -> int:
        return self.block_manager.num_free - self._fork_reserve

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        end = seq.num_computed + n
        needed = max(self.block_manager.num_blocks_for(end) - len(seq.block_table), 0)
        return needed + self._fork_cost(seq, end)

    def _fork_cost(self, seq: Sequence, end: int) -> int:
        if not seq.fork_children or end != seq.num_tokens:
            return 0
        return self.block_manager.fork_cost(end) * len(seq.fork_children)

    def _add(self, batch: Batch, seq: Sequence, n: int) -> None:
        self._fork_reserve += self._fork_cost(seq, seq.num_computed + n)
        batch.add(seq, n)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # --- after the forward pass -----------------------------------------------------------------

    def postprocess(self, batch: Batch) -> list[tuple[int, Sequence]]:
        """Advance computed positions and fork siblings; return (logits row, seq) to sample."""
        to_sample: list[tuple[int, Sequence]] = []
        row = 0
        for chunk, seq in zip(batch.chunks, batch.seqs, strict=True):
            seq.num_computed += len(chunk.token_ids)
            self._commit(seq, chunk.start_pos)
            if not chunk.needs_logits:
                continue
            to_sample.append((row, seq))
            for child in seq.fork_children:
                child.block_table = self.block_manager.fork(seq.block_table, seq.num_computed,
                                                            self.copy_block)
                child.num_computed = seq.num_computed
                child.num_cached_tokens = seq.num_cached_tokens
                child.block_hashes = list(seq.block_hashes)  # same prompt, same hashes
                child.status = SeqStatus.RUNNING
                self.num_paused += child.paused
                self.running.append(child)
                to_sample.append((row, child))
            seq.fork_children.clear()
            row += 1
        return to_sample

    def _commit(self, seq: Sequence, start_pos: int) -> None:
        """Register the blocks this pass filled (their KV now exists) in the prefix cache."""
        bm = self.block_manager
        if not bm.enable_caching:
            return
        first, end = start_pos // bm.block_size, seq.num_computed // bm.block_size
        if end > first:
            hashes = chain_hashes(seq.token_ids, seq.block_hashes, bm.block_size, end)
            bm.commit(seq.block_table, hashes, first, end)

    def finish(self, seq: Sequence) -> None:
        """A sequence ended normally: give back its blocks."""
        self.remove(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out wherever it is (abort or finish) and free its blocks."""
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            self.num_paused -= seq.paused
        elif seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.num_paused -= seq.paused
        self.block_manager.free(seq.block_table)
        seq.status = SeqStatus.FINISHED
