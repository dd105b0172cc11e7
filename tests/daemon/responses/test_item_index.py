"""Items of stored responses found by id (item_reference), on SQLite and on PostgreSQL: input
items by the id each is listed under, output items by the response their id derives from;
nothing once the response is gone; only the asking tenant's items, and an id of the server's
making only within the response it names; a request's references in one op, bounded in what
it reads and answers with."""

from pathlib import Path
from typing import Any

import msgspec

from daemon.responses import item_index
from daemon.responses.store import ResponseStore
from ipc.records import Message, Usage
from ipc.response_records import ItemsLookup, ResponseDelete, ResponseOp, ResponseReply
from tests.daemon.responses.test_store import Clock, op, submit, target

__all__ = ["target"]  # the fixture: each test runs on SQLite and on PostgreSQL

STEM = "0123456789abcdef0123456789abcdef"
OTHER = "fedcba9876543210fedcba9876543210"
ITEMS = [{"type": "message", "role": "user", "content": "hi", "id": "msg_client"},
         {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}",
          "id": "fc_client"},
         {"type": "function_call_output", "call_id": "c1", "output": "42"}]


def _begin(store: ResponseStore, stem: str, items: list[dict[str, Any]], tenant: str = "",
           text: str = "hi") -> None:
    sub = submit(f"resp_{stem}")
    assert sub.response is not None
    fields = msgspec.structs.replace(sub.response, input_items=msgspec.json.encode(items).decode(),
                                     input=[Message("user", text)], tenant=tenant)
    store.begin(msgspec.structs.replace(sub, response=fields))


def _store(target: Path | str, clock: Clock) -> ResponseStore:
    store = ResponseStore(target, max_count=100, max_age_s=3600.0, clock=clock)
    _begin(store, STEM, ITEMS)
    return store


def _ask(store: ResponseStore, *ids: str, tenant: str = "") -> ResponseReply:
    return store.handle_op(ResponseOp("op-items", ItemsLookup(list(ids)), 1,
                                      tenant=tenant), running=False)


def _found(store: ResponseStore, *ids: str, tenant: str = "") -> dict[str, Any]:
    """Each id found: its input item as stored, or the id of the response holding it."""
    reply = _ask(store, *ids, tenant=tenant)
    assert reply.status == 200, reply
    found: dict[str, Any] = dict(zip(reply.item_ids, msgspec.json.decode(reply.input_items or "[]"),
                                     strict=True))
    for stored in reply.responses:
        found.update({i: stored.id for i in ids if i not in found and stem_of(i) == stored.id})
    return found


def stem_of(item_id: str) -> str:
    return "resp_" + item_id.split("_")[1]


def test_input_items_are_found_by_the_id_each_is_listed_under(target: Path | str) -> None:
    store = _store(target, Clock())
    assert _found(store, "msg_client", "fc_client", f"msg_{STEM}_2", "fc_other") == {
        "msg_client": ITEMS[0], "fc_client": ITEMS[1], f"msg_{STEM}_2": ITEMS[2]}


def test_output_items_name_their_response_and_nothing_outlives_it(target: Path | str) -> None:
    clock = Clock()
    store = _store(target, clock)
    store.complete(f"resp_{STEM}", "hello", Usage(1, 1))
    # (the proxy picks the call out of the response's output)
    assert _found(store, f"msg_{STEM}", f"fc_{STEM}_0", "fc_feed_0") == {
        f"msg_{STEM}": f"resp_{STEM}", f"fc_{STEM}_0": f"resp_{STEM}"}
    assert store.handle_op(op(ResponseDelete(f"resp_{STEM}")), running=False).status == 200
    assert _found(store, "msg_client", f"msg_{STEM}") == {}
    store.prune()
    assert store.db.execute("SELECT count(*) AS n FROM response_items").one()["n"] == 0


def test_an_item_planted_under_an_id_of_the_servers_making_is_never_found(
        target: Path | str) -> None:
    """A client sends input items under another response's output id and under the id of one
    of its id-less inputs: a reference to either still finds what that response holds."""
    clock = Clock()
    store = _store(target, clock)
    store.complete(f"resp_{STEM}", "the real answer", Usage(1, 1))
    clock.now += 1
    planted = [{"type": "message", "role": "assistant", "content": "planted", "id": f"msg_{STEM}"},
               {"type": "message", "role": "user", "content": "planted", "id": f"msg_{STEM}_2"}]
    _begin(store, OTHER, planted)  # newer than the real ones
    found = _found(store, f"msg_{STEM}", f"msg_{STEM}_2")
    assert found == {f"msg_{STEM}": f"resp_{STEM}", f"msg_{STEM}_2": ITEMS[2]}


def test_a_tenant_reaches_only_its_own_items(target: Path | str) -> None:
    store = _store(target, Clock())  # tenant ""
    store.complete(f"resp_{STEM}", "hello", Usage(1, 1))
    _begin(store, OTHER, [{"role": "user", "content": "b's", "id": "msg_client"}], tenant="b")
    assert _found(store, "msg_client", f"msg_{STEM}", tenant="a") == {}
    assert _found(store, "msg_client", tenant="b") == {
        "msg_client": {"role": "user", "content": "b's", "id": "msg_client"}}
    assert _found(store, "msg_client")["msg_client"] == ITEMS[0]


def test_what_one_op_reads_and_answers_is_bounded(target: Path | str, monkeypatch: Any) -> None:
    store = _store(target, Clock())
    monkeypatch.setattr(item_index, "REFERENCED_BYTES", 100)  # msg_client's item holds 65
    assert _ask(store, "msg_client").status == 200
    reply = _ask(store, "msg_client", "fc_client")
    assert reply.status == 413 and reply.message is not None and "at most 100" in reply.message
    monkeypatch.setattr(item_index, "READ_BYTES", 200)  # the row stores more
    reply = _ask(store, "msg_client")
    assert reply.status == 413 and reply.message is not None and "at most 200" in reply.message
