import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.engine.block_manager import BlockManager, OutOfBlocks, chain_hashes
from daemon.engine.scheduler import Scheduler
from daemon.engine.sequence import Sequence
from daemon.model.tokenizer import ByteTokenizer
from ipc.records import SamplingParams

TOK = ByteTokenizer()


def check_ref_counts(bm: BlockManager, tables: list[list[int]]) -> None:
    counts = [0] * bm.num_total
    for table in tables:
        for block in table:
            counts[block] += 1
    assert counts == [bm.ref_count(b) for b in range(bm.num_total)]
    assert bm.num_used == sum(1 for c in counts if c)


def allocate(bm: BlockManager, num_tokens: int) -> list[int]:
    table: list[int] = []
    bm.may_append(table, num_tokens)
    return table


def test_allocate_and_free_round_trip():
    bm = BlockManager(4)
    table = allocate(bm, 17)
    assert len(table) == 2 and bm.num_used == 2
    bm.free(table)
    assert table == [] and bm.num_used == 0 and bm.num_free == 4


def test_may_append_grows_only_at_block_boundaries():
    bm = BlockManager(4)
    table = allocate(bm, 16)
    bm.may_append(table, 16)
    assert len(table) == 1
    bm.may_append(table, 17)
    assert len(table) == 2


def test_cannot_allocate_beyond_pool():
    bm = BlockManager(2)
    with pytest.raises(OutOfBlocks):
        allocate(bm, 33)
    assert bm.num_used == 0


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(8)
    parent = allocate(bm, 20)
    copies: list[tuple[int, int]] = []
    child = bm.fork(parent, 20, lambda s, d: copies.append((s, d)))
    assert child[0] == parent[0] and bm.ref_count(parent[0]) == 2
    assert child[1] != parent[1] and copies == [(parent[1], child[1])]
    bm.free(parent)
    assert bm.ref_count(child[0]) == 1 and bm.num_used == 2
    bm.free(child)
    assert bm.num_used == 0


def test_fork_at_a_block_boundary_copies_nothing():
    bm = BlockManager(4)
    parent = allocate(bm, 32)
    child = bm.fork(parent, 32, lambda s, d: pytest.fail("no copy expected"))
    assert child == parent and bm.num_used == 2


def test_double_free_is_refused():
    bm = BlockManager(2)
    table = allocate(bm, 1)
    alias = list(table)
    bm.free(table)
    with pytest.raises(RuntimeError):
        bm.free(alias)


def make_seq(prompt_len: int, n: int, max_tokens: int) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens)
    ids = [65 + i % 26 for i in range(prompt_len)]
    group = [Sequence("r", i, list(ids), params)
             for i in range(n)]
    group[0].fork_children = group[1:]
    return group[0]


ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(1, 40), st.integers(1, 3), st.integers(1, 20)),
        st.tuples(st.just("tick"), st.integers(1, 3)),
        st.tuples(st.just("abort"), st.integers(0, 10)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_scheduler_never_leaks_or_double_books_blocks(program):
    bm = BlockManager(12)
    sched = Scheduler(bm, max_num_seqs=6, max_tokens_per_tick=24, copy_block=lambda s, d: None)
    groups: list[list[Sequence]] = []

    def tick() -> None:
        batch = sched.schedule()
        assert batch.num_prefill_tokens + batch.num_decode_tokens <= 24
        for chunk in batch.chunks:
            assert len(chunk.block_table) * 16 >= chunk.start_pos + len(chunk.token_ids)
        sched.update(batch)
        for seq in batch.sampled:
            seq.token_ids.append(1)
            if seq.num_generated >= seq.params.max_tokens:
                sched.finish(seq)

    for op in program:
        if op[0] == "submit":
            parent = make_seq(op[1], op[2], op[3])
            groups.append([parent, *parent.fork_children])
            sched.add(parent)
        elif op[0] == "tick":
            for _ in range(op[1]):
                tick()
        elif groups:
            # An abort ends the whole session, pending forks included.
            for seq in groups[op[1] % len(groups)]:
                if not seq.is_finished:
                    sched.remove(seq)
        live = [s for g in groups for s in g if not s.is_finished]
        check_ref_counts(bm, [s.block_table for s in live])
        assert len(sched.running) <= 6
    for _ in range(500):
        if not sched.has_work:
            break
        tick()
    assert not sched.has_work
    assert bm.num_used == 0


# --- the prefix cache ---------------------------------------------------------------------------


def hashes_of(tokens: list[int], num_blocks: int, block_size: int = 16) -> list[bytes]:
    return chain_hashes(tokens, [], block_size, num_blocks)


def cached_table(bm: BlockManager, tokens: list[int]) -> list[int]:
    """Allocate blocks for `tokens` as if a forward pass wrote them, and register the full ones."""
    table = allocate(bm, len(tokens))
    full = len(tokens) // bm.block_size
    bm.commit(table, hashes_of(tokens, full, bm.block_size), 0, full)
    return table


def test_chain_hashes_name_the_whole_prefix():
    a = list(range(48))
    b = [*a[:16], 99, *a[17:]]  # differs in block 1 only
    ha, hb = hashes_of(a, 3), hashes_of(b, 3)
    assert ha[0] == hb[0] and ha[1] != hb[1] and ha[2] != hb[2]  # block 2 itself is equal
    have = hashes_of(a, 1)
    assert chain_hashes(a, have, 16, 3) is have and have == ha  # extended in place


def test_freed_blocks_stay_reusable_but_count_as_free():
    bm = BlockManager(4)
    tokens = list(range(40))
    table = cached_table(bm, tokens)
    first_two = table[:2]
    bm.free(table)
    assert bm.num_used == 0 and bm.num_free == 4 and bm.num_cached_free == 2
    hits = bm.lookup(hashes_of(tokens, 2))
    assert hits == first_two and bm.num_revived(hits) == 2
    again: list[int] = []
    bm.share(again, hits)
    assert again == first_two and bm.num_used == 2 and bm.num_cached_free == 0
    assert all(bm.ref_count(b) == 1 for b in again)


def test_lookup_stops_at_the_first_miss_and_shares_live_blocks():
    bm = BlockManager(8)
    tokens = list(range(48))
    owner = cached_table(bm, tokens)
    other = [*tokens[:16], *range(100, 132)]
    hits = bm.lookup(hashes_of(other, 3))
    assert hits == owner[:1] and bm.num_revived(hits) == 0
    table: list[int] = []
    bm.share(table, hits)
    assert bm.ref_count(owner[0]) == 2
    check_ref_counts(bm, [owner, table])


def test_uncached_blocks_go_first_then_the_least_recently_freed():
    bm = BlockManager(4)
    old = cached_table(bm, list(range(32)))  # 2 registered blocks
    bm.free(list(old))
    new = cached_table(bm, list(range(100, 116)))  # takes an uncached block
    bm.free(list(new))
    assert bm.num_cached_free == 3
    table = allocate(bm, 16)  # the last uncached block
    assert table[0] not in old + new and bm.num_cached_free == 3
    evicted = allocate(bm, 16)
    # Freed tail first: the old prefix loses its second block, keeps its first.
    assert evicted == [old[1]] and bm.num_cached_free == 2
    assert bm.lookup(hashes_of(list(range(32)), 2)) == [old[0]]
    assert bm.lookup(hashes_of(list(range(100, 116)), 1)) == new


def test_commit_keeps_the_first_block_of_twins():
    bm = BlockManager(4)
    tokens = list(range(16))
    first = cached_table(bm, tokens)
    twin = cached_table(bm, tokens)  # computed in the same tick, before either was registered
    bm.free(twin)
    bm.free(list(first))
    assert bm.num_cached_free == 1 and bm.lookup(hashes_of(tokens, 1)) == first


def test_without_caching_nothing_is_registered():
    bm = BlockManager(4, enable_caching=False)
    tokens = list(range(32))
    table = cached_table(bm, tokens)
    bm.free(table)
    assert bm.num_cached_free == 0 and bm.lookup(hashes_of(tokens, 2)) == []
