"""The scheduler's fairness between requests: a newcomer's first token, shares of the slots and
of the KV blocks, groups queued in turn."""

import pytest

from daemon.engine.scheduler import Scheduler
from daemon.engine.sequence import SeqStatus, Sequence
from tests.support.scheduler_kit import run_tick, scheduler, seq


def first_token_ticks(sched: Scheduler, newcomer: Sequence, limit: int = 10) -> int:
    """Ticks until `newcomer` has sampled its first token (limit + 1: not within `limit`)."""
    for tick in range(1, limit + 1):
        run_tick(sched)
        if newcomer.num_generated:
            return tick
    return limit + 1


@pytest.mark.parametrize(("groups", "n"), [(1, 8), (16, 1), (6, 4), (64, 8)])
def test_a_newcomer_gets_its_first_token_within_two_ticks_whatever_an_earlier_request_holds(
        groups: int, n: int) -> None:
    sched = scheduler(num_blocks=1024, max_num_seqs=8, budget=64)
    for _ in range(groups):
        sched.add(seq(20, n=n, rid="big"))
    for _ in range(3):
        run_tick(sched)
    assert sched.num_slots_used == 8
    small = seq(4, rid="small")
    sched.add(small)
    assert first_token_ticks(sched, small) <= 2
    # One slot was taken back for it, once: the preempted sequence waits for a free slot
    # instead of taking the newcomer's back.
    for _ in range(10):
        run_tick(sched)
    assert sched.num_preemptions == 1 and small.status is SeqStatus.RUNNING
    assert sched.num_slots_used == 8


def test_a_newcomer_does_not_wait_for_another_request_s_long_prompt() -> None:
    sched = scheduler(num_blocks=256, budget=32)
    big = seq(600, rid="big")
    sched.add(big)
    run_tick(sched)
    small = seq(4, rid="small")
    sched.add(small)
    # Prefill chunks take turns between requests: the big prompt's chunk went first last tick.
    assert first_token_ticks(sched, small) <= 2
    assert big.num_generated == 0
    batch = run_tick(sched)
    assert batch.num_prefill_tokens + batch.num_decode_tokens == 32  # the budget stays full


def test_a_second_request_gets_its_share_of_the_slots() -> None:
    sched = scheduler(num_blocks=256, max_num_seqs=8, budget=64)
    sched.add(seq(8, n=8, rid="a"))
    run_tick(sched)
    sched.add(seq(8, n=4, rid="b"))
    run_tick(sched)
    run_tick(sched)
    held = {rid: sum(1 for s in sched.running if s.rid == rid) for rid in ("a", "b")}
    assert held == {"a": 4, "b": 4} and sched.num_preemptions == 4


def test_a_newcomer_gets_kv_blocks_an_earlier_request_holds() -> None:
    sched = scheduler(num_blocks=12, max_num_seqs=8, budget=64)
    big = seq(16, n=2, rid="big")
    sched.add(big)
    for _ in range(200):  # two sequences growing until the pool is full
        run_tick(sched)
        if sched.block_manager.num_free == 0:
            break
    assert sched.block_manager.num_free == 0 and sched.num_slots_used <= 2
    small = seq(4, rid="small")
    sched.add(small)
    assert first_token_ticks(sched, small) <= 2


def test_one_request_alone_still_fills_the_batch() -> None:
    sched = scheduler(num_blocks=256, max_num_seqs=8, budget=64)
    for _ in range(6):
        sched.add(seq(8, n=2, rid="big"))
    first = run_tick(sched)
    assert len(first.seqs) == 4 and sched.num_slots_used == 8
    batch = run_tick(sched)
    assert batch.num_decode_tokens == 8 and sched.num_preemptions == 0
    sched.finish(sched.running[0])
    assert sched.num_slots_used == 7
    run_tick(sched)  # a group of two does not fit in one free slot: it waits
    assert sched.num_slots_used == 7 and len(sched.waiting) == 2


def test_a_group_as_big_as_the_engine_is_not_starved_by_later_small_requests() -> None:
    sched = scheduler(num_blocks=256, max_num_seqs=4, budget=64)
    smalls = [seq(4, rid=f"s{i}") for i in range(4)]
    for s in smalls:
        sched.add(s)
    run_tick(sched)
    group = seq(4, n=4, rid="group")
    sched.add(group)
    for i, s in enumerate(smalls):
        sched.add(seq(4, rid=f"late{i}"))  # arrives after the group: waits behind it
        sched.finish(s)
        run_tick(sched)
    assert group.status is SeqStatus.RUNNING
    assert not any(s.rid.startswith("late") for s in sched.running)


def test_requests_of_a_few_sequences_queue_in_turn_without_preempting_one_another() -> None:
    sched = scheduler(num_blocks=512, max_num_seqs=8, budget=64)
    groups = [seq(8, n=2, rid=f"r{i}") for i in range(8)]
    for group in groups:
        sched.add(group)
    for _ in range(20):
        run_tick(sched)
    assert sched.num_preemptions == 0 and sched.num_slots_used == 8
    assert [g.rid for g in groups if g.status is SeqStatus.RUNNING] == ["r0", "r1", "r2", "r3"]
