"""Items by id, for the Responses API's ``item_reference`` input items: every reference of a
request in one op (ITEMS), answered from the requesting tenant's own responses only.

A stored response's input items are indexed by the id each is listed under (its own, a
client's ``msg_…``/``fc_…`` too, or ``msg_<stem>_<i>``), written with its row. Its output items
need no index: their ids are the server's own, derived from the response id (``msg_<stem>``,
``fc_<stem>_<k>``), so the row they name is read and the proxy, which builds the output items,
picks the one named.

An id of the server's making (``msg_<stem>``, ``msg_<stem>_<i>``, ``fc_<stem>_<k>``, a stem being
a response id's 32 hex digits) resolves only within the response it names, never to an item
another response was sent under that id: a client cannot plant text that another's reference to
an output would find. A client's own ids resolve to the newest of its tenant's responses that
holds one. A lookup reads only rows that still exist, so an index entry outliving its response
(deleted, pruned) never resolves; the watcher's prune drops such entries.

One op's work is bounded: the rows it reads hold at most READ_BYTES, and the items it answers
with at most REFERENCED_BYTES; past either it is a 413 that names the bound.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from daemon.responses.db import Database, Executor
from daemon.responses.items import listed_ids
from daemon.responses.rows import stored_response
from ipc.response_records import ItemsLookup, ResponseOp, ResponseReply

_CHUNK = 256  # rows per INSERT: well under any backend's bound on parameters
# An id of the server's making: a response's stem, then an input item's position or a call's.
_SERVER_ID = re.compile(r"^(?P<kind>msg|fc)_(?P<stem>[0-9a-f]{32})(?:_(?P<index>\d{1,9}))?$")
_raw_items = msgspec.json.Decoder(list[msgspec.Raw])
# What one ITEMS op may read of stored responses, and answer with (a request's references then
# add at most that to its Submit).
READ_BYTES = 32 << 20
REFERENCED_BYTES = 4 << 20

SWEEP_SQL = "DELETE FROM response_items WHERE response_id NOT IN (SELECT id FROM responses)"
_TENANT_INDEX = ("SELECT i.response_id, i.position FROM response_items i JOIN responses r ON "
                 "r.id = i.response_id WHERE i.item_id = ? AND r.tenant = ?")


def index_items(executor: Executor, response_id: str, input_items: str) -> None:
    """Index a response's input items by id; an id given twice names its first item."""
    ids = listed_ids(response_id, input_items.encode())
    rows = [(item_id, response_id, i) for i, item_id in enumerate(ids)]
    for start in range(0, len(rows), _CHUNK):
        chunk = rows[start:start + _CHUNK]
        values = ", ".join(["(?, ?, ?)"] * len(chunk))
        executor.execute(f"INSERT INTO response_items (item_id, response_id, position) VALUES "
                         f"{values} ON CONFLICT (item_id, response_id) DO NOTHING",
                         tuple(v for row in chunk for v in row))


def _place(db: Database, item_id: str, tenant: str) -> tuple[str, int | None] | None:
    """Where ``item_id`` is: (response id, input position), or (response id, None) for an
    output item of that response; None when no response of ``tenant`` holds it."""
    made = _SERVER_ID.match(item_id)
    if made is None:
        row = db.execute(_TENANT_INDEX + " ORDER BY r.stored_at DESC LIMIT 1",
                         (item_id, tenant)).one()
        return None if row is None else (row["response_id"], row["position"])
    rid = "resp_" + made.group("stem")
    if made.group("kind") == "msg" and made.group("index") is not None:  # an id-less input
        row = db.execute(_TENANT_INDEX + " AND i.response_id = ?", (item_id, tenant, rid)).one()
        return None if row is None else (rid, row["position"])
    owner = db.execute("SELECT id FROM responses WHERE id = ? AND tenant = ?",
                       (rid, tenant)).one()
    return None if owner is None else (rid, None)


def references_reply(db: Database, op: ResponseOp, lookup: ItemsLookup) -> ResponseReply:
    """The items ``lookup.item_ids`` name: the input items found (``input_items``, with their ids
    in ``item_ids``) and the responses whose output holds the others (``responses``). An id
    found nowhere is left out: the proxy names it."""
    places = {i: p for i in dict.fromkeys(lookup.item_ids)
              if (p := _place(db, i, op.tenant)) is not None}
    rids = sorted({rid for rid, _ in places.values()})
    if not rids:
        return ResponseReply(op.op_id, 200, input_items="[]")
    marks = ", ".join(["?"] * len(rids))
    size = db.execute(f"SELECT coalesce(sum(size), 0) AS n FROM responses WHERE id IN ({marks})",
                      rids).one()["n"]
    if size > READ_BYTES:
        return _too_much(op, f"the responses they are items of hold {size} bytes; one request's "
                         f"references may read at most {READ_BYTES}")
    rows = {r["id"]: r for r in db.execute(f"SELECT * FROM responses WHERE id IN ({marks})",
                                           rids).rows}
    found, ids, outputs = [], [], {}
    for item_id, (rid, position) in places.items():
        row = rows.get(rid)
        if row is None:  # gone since (another replica)
            continue
        if position is None:
            outputs[rid] = row
        else:
            found.append(bytes(_raw_items.decode(row["input_items"].encode())[position]))
            ids.append(item_id)
    answered = sum(map(len, found)) + sum(_output_bytes(r) for r in outputs.values())
    if answered > REFERENCED_BYTES:
        return _too_much(op, f"they name {answered} bytes of items; one request's references "
                         f"may name at most {REFERENCED_BYTES}")
    return ResponseReply(op.op_id, 200, input_items=(b"[" + b",".join(found) + b"]").decode(),
                         item_ids=ids, responses=[stored_response(r) for r in outputs.values()])


def _output_bytes(row: Any) -> int:
    """What a response's output items can hold: its stored text but its input."""
    return int(row["size"]) - len(row["input_items"].encode()) - len(row["messages"].encode())


def _too_much(op: ResponseOp, why: str) -> ResponseReply:
    return ResponseReply(op.op_id, 413, param="input",
                         message=f"the item references of this request cannot be served: {why}")
