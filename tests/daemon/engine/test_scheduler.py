from daemon.engine.block_manager import BlockManager
from daemon.engine.scheduler import Scheduler
from daemon.engine.sequence import SeqStatus, Sequence
from ipc.records import SamplingParams
from tests.support.scheduler_kit import run_tick, scheduler, seq


def test_long_prompt_is_prefilled_in_chunks_under_the_budget():
    sched = scheduler(budget=32)
    s = seq(50)
    sched.add(s)
    first = run_tick(sched)
    assert [len(c.token_ids) for c in first.chunks] == [32]
    assert not first.chunks[0].needs_logits and s.num_generated == 0
    second = run_tick(sched)
    assert second.chunks[0].start_pos == 32 and len(second.chunks[0].token_ids) == 18
    assert second.chunks[0].needs_logits and s.num_generated == 1


def test_decodes_come_first_and_prefill_takes_the_rest_of_the_budget():
    sched = scheduler(budget=20)
    a = seq(5, rid="a")
    sched.add(a)
    run_tick(sched)
    b = seq(40, rid="b")
    sched.add(b)
    batch = run_tick(sched)
    assert batch.seqs == [a, b]
    assert [len(c.token_ids) for c in batch.chunks] == [1, 19]
    assert batch.num_decode_tokens == 1 and batch.num_prefill_tokens == 19


def test_max_num_seqs_limits_admission():
    sched = scheduler(max_num_seqs=2)
    seqs = [seq(4, rid=str(i)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = run_tick(sched)
    assert batch.seqs == seqs[:2]
    assert list(sched.waiting) == [seqs[2]]


def test_fork_children_count_against_max_num_seqs():
    sched = scheduler(max_num_seqs=3)
    sched.add(seq(4, n=3, rid="a"))
    sched.add(seq(4, rid="b"))
    run_tick(sched)
    assert len(sched.running) == 3
    assert [s.rid for s in sched.waiting] == ["b"]


def test_newest_running_sequence_is_preempted_when_blocks_run_out():
    sched = scheduler(num_blocks=2, budget=64)
    old, new = seq(16, rid="old"), seq(15, rid="new")
    sched.add(old)
    sched.add(new)
    run_tick(sched)  # both prefilled: 1 block each, old now needs a second block
    assert sched.block_manager.num_free == 0
    batch = run_tick(sched)
    assert batch.seqs == [old]
    assert new.status is SeqStatus.WAITING and new.num_computed == 0
    assert list(sched.waiting) == [new] and sched.num_preemptions == 1
    # The preempted sequence keeps its sampled token and recomputes it with the prompt.
    assert new.num_tokens == 16


def test_preempted_sequence_is_recomputed_with_its_generated_tokens():
    sched = scheduler(num_blocks=2, budget=64)
    old, new = seq(16, rid="old"), seq(15, rid="new")
    sched.add(old)
    sched.add(new)
    run_tick(sched)
    run_tick(sched)
    sched.finish(old)
    batch = run_tick(sched)
    assert batch.seqs == [new]
    assert batch.chunks[0].start_pos == 0 and len(batch.chunks[0].token_ids) == 16
    assert batch.chunks[0].needs_logits


def test_removed_waiting_sequence_is_never_scheduled():
    sched = scheduler(max_num_seqs=1)
    a, b = seq(4, rid="a"), seq(4, rid="b")
    sched.add(a)
    sched.add(b)
    run_tick(sched)
    sched.remove(b)
    for _ in range(5):
        batch = run_tick(sched)
        assert b not in batch.seqs
    sched.finish(a)
    assert not sched.has_work and sched.schedule().seqs == []


def test_n_children_fork_the_prompt_blocks_once_it_is_prefilled():
    copies: list[tuple[int, int]] = []
    sched = scheduler(copies=copies)
    parent = seq(20, n=3)
    children = list(parent.fork_children)
    sched.add(parent)
    batch = sched.schedule()
    assert batch.seqs == [parent]  # the prompt is computed once
    sampled, rows = batch.sampled, batch.rows
    sched.update(batch)
    assert [(row, s.index) for row, s in zip(rows, sampled, strict=True)] == [(0, 0), (0, 1), (0, 2)]
    full = parent.block_table[0]
    assert all(c.block_table[0] == full for c in children)
    assert sched.block_manager.ref_count(full) == 3
    partials = {s.block_table[1] for s in [parent, *children]}
    assert len(partials) == 3
    assert copies == [(parent.block_table[1], c.block_table[1]) for c in children]
    assert all(c.num_computed == 20 and c.status is SeqStatus.RUNNING for c in children)


def test_fork_waits_until_blocks_for_the_copies_are_free():
    sched = scheduler(num_blocks=3)
    hog = seq(16, rid="hog")
    sched.add(hog)
    run_tick(sched)  # hog: 1 block, 2 free; the group needs 2 + 2 copies
    group = seq(20, n=3, rid="g")
    sched.add(group)
    batch = run_tick(sched)
    assert group not in batch.seqs and list(sched.waiting) == [group]


# --- prefix caching ----------------------------------------------------------------------------


def seq_of(tokens: list[int], rid: str, n: int = 1) -> Sequence:
    group = [Sequence(rid, i, list(tokens), SamplingParams()) for i in range(n)]
    group[0].fork_children = group[1:]
    return group[0]


PROMPT = [97 + i % 26 for i in range(40)]


def test_a_second_prompt_with_the_same_start_computes_only_the_rest():
    sched = scheduler()
    first = seq_of(PROMPT, "first")
    sched.add(first)
    run_tick(sched)
    sched.finish(first)
    bm = sched.block_manager
    assert bm.num_used == 0 and bm.num_cached_free == 2  # blocks 0-1 full, block 2 partial
    second = seq_of([*PROMPT, 1, 2], "second")
    sched.add(second)
    batch = run_tick(sched)
    assert [(c.start_pos, len(c.token_ids)) for c in batch.chunks] == [(32, 10)]
    assert batch.num_prefill_tokens == 10 and second.num_cached_tokens == 32
    assert (sched.num_cache_queries, sched.num_cache_hits) == (40 + 42, 32)
    assert bm.num_cached_free == 0 and bm.num_used == 3


def test_the_last_prompt_token_is_always_computed():
    sched = scheduler()
    tokens = PROMPT[:32]
    first = seq_of(tokens, "first")
    sched.add(first)
    run_tick(sched)
    sched.finish(first)
    second = seq_of(tokens, "second")
    sched.add(second)
    batch = run_tick(sched)
    # Both blocks are cached, but the logits of position 31 are needed: block 1 is computed.
    assert [(c.start_pos, len(c.token_ids)) for c in batch.chunks] == [(16, 16)]
    assert batch.chunks[0].needs_logits and second.num_cached_tokens == 16


def test_blocks_are_registered_after_the_pass_that_wrote_them():
    sched = scheduler(budget=128)
    twins = [seq_of(PROMPT, "a"), seq_of(PROMPT, "b")]
    for s in twins:
        sched.add(s)
    batch = run_tick(sched)  # one pass: neither can reuse what the other is only now writing
    assert [(c.start_pos, len(c.token_ids)) for c in batch.chunks] == [(0, 40), (0, 40)]
    assert [s.num_cached_tokens for s in twins] == [0, 0]
    late = seq_of(PROMPT, "c")
    sched.add(late)
    batch = run_tick(sched)
    assert [(c.start_pos, len(c.token_ids)) for c in batch.chunks] == [(40, 1), (40, 1), (32, 8)]
    assert late.block_table[:2] == twins[0].block_table[:2]


def test_chunked_prefill_registers_each_chunk_as_it_completes():
    sched = scheduler(budget=20)
    first = seq_of(PROMPT, "first")
    sched.add(first)
    run_tick(sched)  # positions 0-19: block 0 full
    follower = seq_of(PROMPT, "follower")
    sched.add(follower)
    batch = run_tick(sched)  # first: 20-39 (block 1 full); follower: nothing left of the budget
    assert batch.seqs == [first] and follower.status is SeqStatus.WAITING
    batch = run_tick(sched)
    # The follower finds both blocks although `first` is still running.
    assert follower.num_cached_tokens == 32 and follower.block_table[:2] == first.block_table[:2]
    assert sched.block_manager.ref_count(first.block_table[0]) == 2


def test_forks_share_cached_blocks_and_copy_the_partial_one():
    copies: list[tuple[int, int]] = []
    sched = scheduler(copies=copies)
    warm = seq_of(PROMPT, "warm")
    sched.add(warm)
    run_tick(sched)
    sched.finish(warm)
    parent = seq_of(PROMPT, "g", n=3)
    children = list(parent.fork_children)
    sched.add(parent)
    batch = sched.schedule()
    assert [(c.start_pos, len(c.token_ids)) for c in batch.chunks] == [(32, 8)]
    sched.update(batch)
    shared = parent.block_table[:2]
    assert all(c.block_table[:2] == shared for c in children)
    assert all(sched.block_manager.ref_count(b) == 3 for b in shared)
    assert len(copies) == 2 and all(c.num_cached_tokens == 32 for c in children)


def test_a_preempted_sequence_finds_its_own_blocks_again():
    sched = scheduler(num_blocks=4, budget=64)
    a = seq_of([1] * 16, "a")
    b = seq_of(PROMPT[:32], "b")
    sched.add(a)
    sched.add(b)
    run_tick(sched)  # a: 1 block, b: 2 blocks; both sampled a token and need one more block
    run_tick(sched)  # a takes the last free block; b cannot grow and is preempted
    assert b.status is SeqStatus.WAITING and sched.num_preemptions == 1
    assert sched.block_manager.num_cached_free == 2
    sched.finish(a)
    batch = run_tick(sched)
    assert batch.seqs == [b]
    # Only the token it was preempted before decoding is left to compute.
    assert [(c.start_pos, len(c.token_ids)) for c in batch.chunks] == [(32, 1)]
    assert b.num_cached_tokens == 0  # usage reports the first admission


def test_without_caching_every_prompt_is_computed_in_full():
    sched = Scheduler(BlockManager(64, enable_caching=False), 8, 64, lambda s, d: None)
    for rid in ("a", "b"):
        s = seq_of(PROMPT, rid)
        sched.add(s)
        batch = run_tick(sched)
        sched.finish(s)
        assert [(c.start_pos, len(c.token_ids)) for c in batch.chunks] == [(0, 40)]
    assert (sched.num_cache_queries, sched.num_cache_hits) == (0, 0)


def test_a_paused_sequence_keeps_its_blocks_and_waits_without_holding_up_others():
    sched = scheduler(max_num_seqs=2)
    a, b, c = seq(4, rid="a"), seq(4, rid="b"), seq(4, rid="c")
    sched.add(a)
    run_tick(sched)
    sched.set_paused([a], True)
    held = list(a.block_table)
    assert not sched.has_work
    sched.add(b)
    sched.set_paused([b], True)  # paused while still waiting
    sched.add(c)
    batch = run_tick(sched)
    assert batch.seqs == [c] and list(sched.waiting) == [b]  # c passed the paused b
    assert a.block_table == held and a.status is SeqStatus.RUNNING
    sched.set_paused([a, b], False)
    sched.finish(c)
    assert run_tick(sched).seqs == [a, b]
    assert sched.num_paused == 0


def test_paused_sequences_are_preempted_first_and_removal_forgets_them():
    sched = scheduler(num_blocks=3, budget=64)
    old, paused, new = seq(16, rid="old"), seq(15, rid="paused"), seq(15, rid="new")
    for s in (old, paused, new):
        sched.add(s)
    run_tick(sched)  # one block each; old now needs a second
    sched.set_paused([paused], True)
    batch = run_tick(sched)
    assert paused.status is SeqStatus.WAITING and new in batch.seqs  # not the newest: paused
    sched.remove(paused)
    assert sched.num_paused == 0


def test_a_one_token_prompt_chunk_is_prefill_not_decode():
    sched = scheduler(budget=8)
    s = seq(9)
    sched.add(s)
    run_tick(sched)
    last = run_tick(sched)
    assert (last.num_prefill_tokens, last.num_decode_tokens) == (1, 0)
    assert run_tick(sched).num_decode_tokens == 1
