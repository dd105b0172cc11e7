"""Continuous batching: which sequences, and which of their tokens, go into the next forward pass.

One tick mixes decodes (one token per running sequence, scheduled first so latency stays flat)
with prefill chunks (chunked prefill under a token budget). The scheduler alone owns the block
manager. When blocks run out a running sequence that is not yet in this tick's batch is
preempted and later recomputed from its tokens: paused ones first, then (while others wait)
those of a request over its share, then the newest (whom: preemption.py). A paused sequence
(its client is not reading: flow control) keeps its place and its blocks but is never
scheduled until resumed.

Requests take turns, not sequences (turns.py): prompt chunks and admissions go request by
request, the one served longest ago first (a preempted sequence's request goes back to the
front). Before the tick, a request waiting within its share takes room back from a big one
(over its share and over a quarter of the slots, or over its share of the blocks), which gives
up its newest sequences and waits its turn for them; so however many
sequences a request has, another's first token comes within a tick or two. Requests of a few
sequences each never preempt one another: when they outnumber the slots they queue in turn.
Alone, a request's share is the whole engine.

Prefix caching happens at admission: a waiting sequence starts from the longest run of its full
blocks found in the cache (a preempted one often finds its own), and every block that a forward
pass fills is registered after that pass. The last token is always computed: its logits are
the point of the pass.
"""

from __future__ import annotations

from collections.abc import Callable

from daemon.engine.batch import Batch
from daemon.engine.block_manager import BlockManager, chain_hashes
from daemon.engine.preemption import reserve_victim, room_victim
from daemon.engine.sequence import SeqStatus, Sequence
from daemon.engine.speculative import Speculation
from daemon.engine.turns import Request, Turns, slots_of


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_tokens_per_tick: int,
                 copy_block: Callable[[int, int], None],
                 speculation: Speculation | None = None) -> None:
        if max_tokens_per_tick < max_num_seqs:
            # Otherwise some running sequences could not decode in a tick and would starve.
            raise ValueError(f"max_tokens_per_tick ({max_tokens_per_tick}) must be >= "
                             f"max_num_seqs ({max_num_seqs})")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_tokens_per_tick = max_tokens_per_tick
        self.copy_block = copy_block
        self.speculation = speculation  # n-gram drafts for decodes; None: off
        self.turns = Turns(max_num_seqs, block_manager.num_total)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Prefix-cache lookups, in tokens (vLLM's queries/hits): every admission counts.
        self.num_cache_queries = 0
        self.num_cache_hits = 0
        self.num_paused = 0  # paused sequences in waiting or running
        # Blocks promised to this tick's forks (taken in update, after the forward pass).
        self._fork_reserve = 0
        # Slots and blocks kept this tick for requests within their share (see _make_room).
        self._room: dict[str, tuple[int, int]] = {}
        self._room_total = (0, 0)

    @property
    def has_work(self) -> bool:
        """Anything schedulable: paused sequences alone are no work."""
        return self.turns.num_waiting + len(self.running) > self.num_paused

    @property
    def waiting(self) -> list[Sequence]:
        """The waiting sequences, request by request in turn order."""
        return self.turns.waiting()

    @property
    def num_slots_used(self) -> int:
        return self.turns.num_slots_used

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; its `fork_children` join it once its prompt is prefilled."""
        seq.status = SeqStatus.WAITING
        for child in seq.fork_children:
            child.status = SeqStatus.FORK_PENDING
        self.turns.queue(seq)

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
        self._fork_reserve = 0
        scheduled: set[int] = set()
        self._make_room()
        budget = self._decode(batch, self.max_tokens_per_tick, scheduled)
        self._prefill(batch, budget, scheduled)
        return batch

    def _decode(self, batch: Batch, budget: int, scheduled: set[int]) -> int:
        """One token for each running sequence that has one to compute, in order, while the
        budget lasts; the budget left."""
        running = SeqStatus.RUNNING  # read once: an enum member's lookup costs per sequence
        ready = [seq for seq in self.running if seq.status is running
                 and not seq.paused and len(seq.token_ids) - seq.num_computed == 1][:budget]
        if self.speculation is not None:
            used = self._decode_drafted(batch, ready, budget - len(ready), scheduled)
            if used:
                return budget - used
        bm = self.block_manager
        size = bm.block_size
        # A decode at position p takes a block when its table ends before p (p = num_computed).
        growing = [seq for seq in ready if len(seq.block_table) * size <= seq.num_computed]
        forking = [seq for seq in ready if seq.fork_children]
        forks = sum([self._fork_cost(seq, seq.num_computed + 1) for seq in forking])
        if len(growing) + forks <= self._num_available:
            # Everyone's blocks are free: nobody is preempted, so no _reserve per sequence.
            for seq in growing:
                bm.may_append(seq.block_table, seq.num_computed + 1)
            self._fork_reserve += forks
            batch.add_decodes(ready, forking=bool(forking))
            scheduled.update([seq.seq_id for seq in ready])
            return budget - len(ready)
        for seq in list(self.running):
            if budget == 0:
                break
            if (seq.status is SeqStatus.RUNNING and not seq.paused and seq.num_uncomputed == 1
                    and seq.seq_id not in scheduled and self._reserve(seq, 1, scheduled)):
                self._add(batch, seq, 1, scheduled)
                budget -= 1
        return budget

    def _decode_drafted(self, batch: Batch, ready: list[Sequence], spare: int,
                        scheduled: set[int]) -> int:
        """`ready`'s decodes with the drafts each proposes within `spare` tokens, if all their
        blocks are free (speculation never preempts); the tokens scheduled, or 0: not done."""
        assert self.speculation is not None
        drafts = self.speculation.step_drafts(ready, spare)
        if not any(drafts):
            return 0
        sizes = [1 + len(d) for d in drafts]
        # _blocks_needed counts each one's forks; the room kept for waiting requests stays.
        if sum(map(self._blocks_needed, ready, sizes)) + self._room_total[1] > self._num_available:
            return 0
        for seq, n in zip(ready, sizes, strict=True):
            self.block_manager.may_append(seq.block_table, seq.num_computed + n)
        self._fork_reserve += sum([self._fork_cost(seq, seq.num_computed + 1) for seq in ready])
        batch.add_decodes([seq for seq, d in zip(ready, drafts, strict=True) if not d],
                          forking=any([seq.fork_children for seq in ready]))
        for seq, proposed in zip(ready, drafts, strict=True):
            if proposed:
                batch.add_drafted(seq, proposed)
        scheduled.update([seq.seq_id for seq in ready])
        return len(ready) + sum(map(len, drafts))

    def _prefill(self, batch: Batch, budget: int, scheduled: set[int]) -> None:
        """Prompt chunks and admissions, request by request in turn order."""
        chunks: dict[str, list[Sequence]] = {}
        for seq in self.running:
            if len(seq.token_ids) - seq.num_computed > 1 and not seq.paused:
                chunks.setdefault(seq.rid, []).append(seq)
        if not chunks and not self.turns.num_waiting:
            return  # no prompt to serve: no request's turn to look at
        served: list[str] = []
        admitting = True
        for rid, request in list(self.turns.requests.items()):
            if budget == 0 or not (admitting or chunks):
                break
            before = budget
            for seq in chunks.pop(rid, ()):
                n = min(seq.num_uncomputed, budget)
                if n and seq.status is SeqStatus.RUNNING and self._reserve(seq, n, scheduled):
                    self._add(batch, seq, n, scheduled)
                    budget -= n
            while admitting and budget and request.next is not None:
                n = self._admit(batch, rid, request, budget, scheduled)
                if not n:
                    # A request holding nothing waits at the head: nobody overtakes it (a
                    # group as big as the engine would never find enough free slots).
                    admitting = request.slots > 0
                    break
                budget -= n
            if budget != before:
                served.append(rid)
        self.turns.served(served)

    def _admit(self, batch: Batch, rid: str, request: Request, budget: int,
               scheduled: set[int]) -> int:
        """Admit the request's next sequence with up to `budget` tokens of its prompt, leaving
        the room made for others; the tokens scheduled, or 0 when it does not fit."""
        bm = self.block_manager
        seq = request.next
        assert seq is not None
        own = self._room.get(rid, (0, 0))
        others = (self._room_total[0] - own[0], self._room_total[1] - own[1])
        if self.num_slots_used + slots_of(seq) + others[0] > self.max_num_seqs:
            return 0
        hits, n, need = self._admission(seq, budget)
        if need + others[1] > self._num_available:
            return 0
        if self._room.pop(rid, None) is not None:
            self._room_total = others
        self.turns.start(request)
        cached = len(hits) * bm.block_size
        bm.share(seq.block_table, hits)
        seq.num_computed = cached
        self._count_lookup(seq, cached)
        bm.may_append(seq.block_table, cached + n)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self._add(batch, seq, n, scheduled)
        return n

    def _admission(self, seq: Sequence, budget: int) -> tuple[list[int], int, int]:
        """A waiting sequence's cache hits, the tokens it would compute now and the free
        blocks that takes (its forks' copies included)."""
        bm = self.block_manager
        hits = self._cache_hits(seq)
        cached = len(hits) * bm.block_size
        n = min(seq.num_tokens - cached, budget)
        end = cached + n
        need = (bm.num_blocks_for(end) - len(hits) + bm.num_revived(hits)
                + self._fork_cost(seq, end))
        return hits, n, need

    def _cache_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks for the start of a sequence that holds none yet."""
        bm = self.block_manager
        if not bm.enable_caching or seq.wants_prompt_logits:  # a cached position has no logits
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
        """Blocks for `n` more tokens of a running sequence, preempting others if needed."""
        while self._blocks_needed(seq, n) > self._num_available:
            victim = reserve_victim(seq, self.running, scheduled, self.turns)
            if victim is None or victim is seq:
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

    def _add(self, batch: Batch, seq: Sequence, n: int, scheduled: set[int]) -> None:
        self._fork_reserve += self._fork_cost(seq, seq.num_computed + n)
        batch.add(seq, n)
        scheduled.add(seq.seq_id)

    def _preempt(self, seq: Sequence, *, gave_way: bool = False) -> None:
        self.running.remove(seq)
        self.turns.stop(seq)
        self.block_manager.free(seq.block_table)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.turns.requeue(seq, first=not gave_way)
        self.num_preemptions += 1

    # --- room for a request within its share -----------------------------------------------------

    def _make_room(self) -> None:
        """Before a tick: each waiting request within its share whose next group does not fit
        takes room back from a big request over its own (its newest sequences, recomputed
        later), so that a newcomer waits a tick or two however much the others hold."""
        self._room = {}
        self._room_total = (0, 0)
        if not self.turns.num_waiting:
            return
        shares = self.turns.shares()
        # What this tick's decodes and the requests before this one in the order will take.
        claimed = (0, self._decode_blocks())
        for rid, request in list(self.turns.requests.items()):
            seq = request.next
            if seq is None or not self.turns.within_share(request, shares.slots):
                continue
            need = (slots_of(seq), self._admission(seq, self.max_tokens_per_tick)[2])
            taken = False
            while (short := self._short(need, claimed)) != (0, 0):
                victim = room_victim(rid, request, seq, short, shares, self.running, self.turns,
                                     self.block_manager)
                if victim is None:
                    break
                decodes = self._blocks_needed(victim, 1) if victim.num_uncomputed == 1 else 0
                self._preempt(victim, gave_way=True)
                claimed = (claimed[0], claimed[1] - decodes)
                taken = True
            if short != (0, 0):
                if not request.slots:
                    return  # it waits at the head (see _prefill): nobody behind gets room
                continue
            claimed = (claimed[0] + need[0], claimed[1] + need[1])
            if taken:
                # Room taken back is kept for it this tick (its victim, or another request
                # before it in the order, would take it again); room that came free goes to
                # whoever's turn it is.
                self._room[rid] = need
                self._room_total = (self._room_total[0] + need[0],
                                    self._room_total[1] + need[1])

    def _short(self, need: tuple[int, int], claimed: tuple[int, int]) -> tuple[int, int]:
        """Slots and blocks missing for `need` once `claimed` has been taken."""
        free_slots = self.max_num_seqs - self.num_slots_used - claimed[0]
        free_blocks = self.block_manager.num_free - claimed[1]
        return max(0, need[0] - free_slots), max(0, need[1] - free_blocks)

    def _decode_blocks(self) -> int:
        """Blocks this tick's decodes will take."""
        return sum(self._blocks_needed(s, 1) for s in self.running
                   if s.num_uncomputed == 1 and not s.paused)

    # --- after the forward pass -----------------------------------------------------------------

    def update(self, batch: Batch, accepted: dict[int, int] | None = None) -> None:
        """After the forward pass: advance computed positions, cache the blocks it filled and
        fork the siblings of the prompts it completed. `accepted`: the drafts each drafted
        sequence (by seq_id) keeps; the KV of the rest is stale, its blocks given back."""
        bm = self.block_manager
        size = bm.block_size if bm.enable_caching else 0
        for chunk, seq in zip(batch.chunks, batch.seqs, strict=True):
            kept = accepted.get(seq.seq_id) if accepted else None
            token_ids = seq.token_ids
            if kept is None:
                seq.num_computed += len(chunk.token_ids)
            else:  # its accepted drafts join its ids in the update phase, after this
                token_ids = token_ids + chunk.token_ids[1:1 + kept]
                seq.num_computed += 1 + kept
                bm.truncate(seq.block_table, seq.num_computed + 1)
            if size and seq.num_computed // size > chunk.start_pos // size:
                self._commit(seq, chunk.start_pos, token_ids)  # the pass filled a block
            if not chunk.needs_logits:
                continue
            if seq.prompt_logprobs is not None:  # gathered in the pass that computed its prompt
                seq.prompt_logprobs = None
            for child in seq.fork_children:
                child.block_table = bm.fork(seq.block_table, seq.num_computed, self.copy_block)
                child.num_computed = seq.num_computed
                child.num_cached_tokens = seq.num_cached_tokens
                child.block_hashes = list(seq.block_hashes)  # same prompt, same hashes
                child.prompt_logprobs = None
                child.status = SeqStatus.RUNNING
                self.num_paused += child.paused
                self.running.append(child)
            seq.fork_children.clear()

    def _commit(self, seq: Sequence, start_pos: int, token_ids: list[int]) -> None:
        """Register the blocks this pass filled (their KV now exists) in the prefix cache."""
        bm = self.block_manager
        first, end = start_pos // bm.block_size, seq.num_computed // bm.block_size
        hashes = chain_hashes(token_ids, seq.block_hashes, bm.block_size, end)
        bm.commit(seq.block_table, hashes, first, end)

    def finish(self, seq: Sequence) -> None:
        """A sequence ended normally: give back its blocks."""
        self.remove(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out wherever it is (abort or finish) and free its blocks."""
        if seq.status is SeqStatus.WAITING:
            self.turns.drop(seq)
            self.num_paused -= seq.paused
        elif seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.turns.stop(seq)
            self.num_paused -= seq.paused
        self.turns.forget_if_idle(seq.rid)
        self.block_manager.free(seq.block_table)
        seq.status = SeqStatus.FINISHED
