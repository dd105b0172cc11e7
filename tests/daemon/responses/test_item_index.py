"""Items of stored responses found by id (item_reference), on SQLite and on PostgreSQL: input
items by the id each is listed under, output items by the response their id derives from;
nothing once the response is gone."""

from pathlib import Path

import msgspec

from daemon.responses.store import ResponseStore
from ipc.records import Message, Usage
from ipc.response_records import ResponseOp, ResponseOpKind
from tests.daemon.responses.test_store import Clock, op, submit, target

__all__ = ["target"]  # the fixture: each test runs on SQLite and on PostgreSQL

STEM = "0123456789abcdef0123456789abcdef"
ITEMS = [{"type": "message", "role": "user", "content": "hi", "id": "msg_client"},
         {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}",
          "id": "fc_client"},
         {"type": "function_call_output", "call_id": "c1", "output": "42"}]


def _store(target: Path | str, clock: Clock) -> ResponseStore:
    store = ResponseStore(target, max_count=100, max_age_s=3600.0,
                          clock=clock)
    sub = submit(f"resp_{STEM}")
    assert sub.response is not None
    fields = msgspec.structs.replace(sub.response, input_items=msgspec.json.encode(ITEMS).decode(),
                                     input=[Message("user", "hi")])
    store.begin(msgspec.structs.replace(sub, response=fields))
    return store


def _item(store: ResponseStore, item_id: str) -> tuple[int, object]:
    reply = store.handle_op(ResponseOp(f"op-{item_id}", ResponseOpKind.ITEM, "", 1,
                                       item_id=item_id), running=False)
    if reply.status != 200:
        return reply.status, reply.message
    if reply.input_items is not None:
        return 200, msgspec.json.decode(reply.input_items)
    assert reply.response is not None
    return 200, reply.response.id


def test_input_items_are_found_by_the_id_each_is_listed_under(target: Path | str) -> None:
    store = _store(target, Clock())
    assert _item(store, "msg_client") == (200, [ITEMS[0]])
    assert _item(store, "fc_client") == (200, [ITEMS[1]])
    assert _item(store, f"msg_{STEM}_2") == (200, [ITEMS[2]])  # stored without an id
    assert _item(store, "fc_other") == (404, "Item with id 'fc_other' not found.")


def test_output_items_name_their_response_and_nothing_outlives_it(target: Path | str) -> None:
    clock = Clock()
    store = _store(target, clock)
    store.complete(f"resp_{STEM}", "hello", Usage(1, 1))
    assert _item(store, f"msg_{STEM}") == (200, f"resp_{STEM}")
    assert _item(store, f"fc_{STEM}_0") == (200, f"resp_{STEM}")  # the proxy picks the call
    assert _item(store, "fc_feed_0")[0] == 404
    assert store.handle_op(op(ResponseOpKind.DELETE, f"resp_{STEM}"), running=False).status == 200
    assert _item(store, "msg_client")[0] == 404
    assert _item(store, f"msg_{STEM}")[0] == 404
    store.prune()
    assert store.db.execute("SELECT count(*) AS n FROM response_items").one()["n"] == 0
