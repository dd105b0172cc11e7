"""The response store's bounds, on SQLite and on PostgreSQL: pruned by count, by age and by
bytes (a row's size is the bytes it stores), and by the housekeeping pass."""


from daemon.responses.store import ResponseStore
from ipc.records import Usage
from tests.daemon.responses.test_store import (
    Clock,
    Open,
    _sizes,
    clock,
    get,
    open_store,
    store,
    submit,
    target,
)

__all__ = ["clock", "open_store", "store", "target"]  # the fixtures these tests take


def test_prune_by_count_drops_the_oldest(open_store: Open, clock: Clock) -> None:
    store = open_store(max_count=3)
    for i in range(5):
        store.begin(submit(f"resp_{i}"))
        store.complete(f"resp_{i}", "x", Usage(1, 1))
        clock.now += 1
    store.begin(submit("resp_live"))
    assert store.prune() == 2
    assert [get(store, f"resp_{i}")[0] for i in range(5)] == [404, 404, 200, 200, 200]
    assert get(store, "resp_live")[0] == 200  # placeholders are never pruned
    assert store.prune() == 0


def test_prune_by_age(store: ResponseStore, clock: Clock) -> None:
    store.begin(submit("resp_old"))
    store.complete("resp_old", "x", Usage(1, 1))
    store.begin(submit("resp_old_live"))
    clock.now += 3000
    store.begin(submit("resp_new"))
    store.complete("resp_new", "x", Usage(1, 1))
    assert store.prune() == 0
    clock.now += 700
    assert store.prune() == 1
    assert get(store, "resp_old")[0] == 404
    assert get(store, "resp_new")[0] == 200
    assert get(store, "resp_old_live")[0] == 200


def test_a_rows_size_is_the_bytes_of_what_it_stores(store: ResponseStore) -> None:
    store.begin(submit("resp_1", "héllo", instructions="be brief"))
    begun = _sizes(store)["resp_1"]
    store.complete("resp_1", "wörld", Usage(2, 1), incomplete_reason="max_output_tokens")
    octets = "length(CAST({} AS BLOB))" if store.db.dialect == "sqlite" else "octet_length({})"
    total = " + ".join(f"coalesce({octets.format(c)}, 0)" for c in (
        "input_items", "messages", "instructions", "output_text", "error", "usage",
        "incomplete_reason", "echo"))
    measured = store.db.execute(f"SELECT {total} AS n FROM responses WHERE id = 'resp_1'").one()
    assert _sizes(store)["resp_1"] == measured["n"] > begun > len("héllo")


def test_prune_by_bytes_drops_the_oldest_finished(open_store: Open, clock: Clock) -> None:
    probe = open_store(replica_id="probe")
    probe.begin(submit("resp_probe", "x" * 100))
    probe.complete("resp_probe", "y" * 100, Usage(1, 1))
    row = _sizes(probe)["resp_probe"]
    probe.db.execute("DELETE FROM responses")
    # Room for the placeholder and two finished rows of the same size.
    store = open_store(max_bytes=3 * row + row // 2)
    store.begin(submit("resp_live", "x" * 100))
    for i in range(4):
        store.begin(submit(f"resp_{i}", "x" * 100))
        store.complete(f"resp_{i}", "y" * 100, Usage(1, 1))
        clock.now += 1
    assert store.prune() == 2
    assert [get(store, f"resp_{i}")[0] for i in range(4)] == [404, 404, 200, 200]
    assert get(store, "resp_live")[0] == 200  # the unfinished count, and stay
    assert store.prune() == 0


def test_housekeeping_prunes(open_store: Open) -> None:
    store = open_store(max_count=10)
    for i in range(30):
        store.begin(submit(f"resp_{i}"))
        store.complete(f"resp_{i}", "x", Usage(1, 1))
    store.watcher().housekeep()
    assert store.num_stored() == 10


def test_retention_is_fair_between_tenants(open_store: Open, clock: Clock) -> None:
    """One tenant's (API key's) flood past a bound evicts none of another's, which holds less
    than its share: the flood's own oldest go, by count and by bytes."""
    store = open_store(max_count=5)
    store.begin(submit("resp_mine", tenant="a"))
    store.complete("resp_mine", "x", Usage(1, 1))
    for i in range(10):
        clock.now += 1
        store.begin(submit(f"resp_{i}", "x" * 1000, tenant="b"))
        store.complete(f"resp_{i}", "x", Usage(1, 1))
    assert store.prune() == 6
    assert get(store, "resp_mine")[0] == 200  # the oldest of all
    assert [get(store, f"resp_{i}")[0] for i in range(10)] == [404] * 6 + [200] * 4
    sizes = _sizes(store)
    store.max_bytes = sizes["resp_mine"] + 2 * sizes["resp_9"]  # its own, and two of theirs
    assert store.prune() == 2
    assert get(store, "resp_mine")[0] == 200
    assert [get(store, f"resp_{i}")[0] for i in range(6, 10)] == [404, 404, 200, 200]
