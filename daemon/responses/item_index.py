"""Items by id, for the Responses API's ``item_reference`` input items.

A stored response's input items are indexed by the id each is listed under (its own, a
client's ``msg_…``/``fc_…`` too, or ``msg_<stem>_<i>``), written with its row. Its output items
need no index: their ids are the server's own, derived from the response id (``msg_<stem>``,
``fc_<stem>_<k>``), so the row they name is read and the proxy, which builds the output items,
picks the one named. A lookup reads only rows that still exist, so an index entry outliving its
response (deleted, pruned) never resolves; the watcher's prune drops such entries.
"""

from __future__ import annotations

import re

import msgspec

from daemon.responses.db import Database, Executor
from daemon.responses.items import listed_ids
from daemon.responses.rows import stored_response
from ipc.response_records import ResponseOp, ResponseReply

_CHUNK = 256  # rows per INSERT: well under any backend's bound on parameters
# An output item's id: the response's stem (a uuid's hex), then a call's index.
_OUTPUT_ID = re.compile(r"^(?:msg_(?P<msg>[0-9a-f]+)|fc_(?P<fc>[0-9a-f]+)_\d+)$")
_raw_items = msgspec.json.Decoder(list[msgspec.Raw])

SWEEP_SQL = "DELETE FROM response_items WHERE response_id NOT IN (SELECT id FROM responses)"


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


def item_reply(db: Database, op: ResponseOp) -> ResponseReply:
    """The item ``op.item_id`` names: an input item as stored (``input_items``, a list of one),
    or the response whose output holds it (``response``); 404 when the store holds neither."""
    item_id = op.item_id or ""
    row = db.execute(
        "SELECT i.response_id, i.position, r.input_items FROM response_items i JOIN responses r"
        " ON r.id = i.response_id WHERE i.item_id = ? ORDER BY r.stored_at DESC LIMIT 1",
        (item_id,)).one()
    if row is not None:
        item = _raw_items.decode(row["input_items"].encode())[row["position"]]
        return ResponseReply(op.op_id, 200, input_items=f"[{bytes(item).decode()}]",
                             item_ids=[item_id])
    output = _OUTPUT_ID.match(item_id)
    if output is not None:
        owner = db.execute("SELECT * FROM responses WHERE id = ?",
                           ("resp_" + (output.group("msg") or output.group("fc")),)).one()
        if owner is not None:
            return ResponseReply(op.op_id, 200, response=stored_response(owner))
    return ResponseReply(op.op_id, 404, message=f"Item with id '{item_id}' not found.")
