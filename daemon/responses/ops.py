"""The proxy's side of the store: GET / DELETE / cancel of a stored response, a page of its
input items and the items a request references (daemon/responses/item_index.py), each a
ResponseOp answered by one ResponseReply (a conversation's ops go to
daemon/responses/conversations.py).

A cancel or delete of a response another replica runs is marked in its row (the store's
``cancel``) and left in ``cancel_requests`` for its owner, whose watcher hands it to its tick.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from daemon.responses.conversations import Conversations
from daemon.responses.db import Database
from daemon.responses.item_index import references_reply
from daemon.responses.items import items_reply
from daemon.responses.rows import stored_response
from ipc.response_records import (
    PLACEHOLDER_STATUSES,
    ItemsLookup,
    ResponseCancel,
    ResponseDelete,
    ResponseGet,
    ResponseInputItems,
    ResponseOp,
    ResponseReply,
    ResponseStatus,
)


class StoreOps:
    """Answers ResponseOps over the store's connection. ``placeholders``: the rows this process
    began and has not ended (the store's own set); ``cancel`` ends a row as cancelled."""

    def __init__(self, db: Database, replica_id: str, clock: Callable[[], float],
                 placeholders: set[str], cancel: Callable[[str], None],
                 conversations: Conversations) -> None:
        self.db = db
        self.replica_id = replica_id
        self.clock = clock
        self.placeholders = placeholders
        self.cancel = cancel
        self.conversations = conversations

    def handle_op(self, op: ResponseOp, running: bool) -> ResponseReply:
        """Answer one ResponseOp. ``running``: the engine holds a live session for this id.

        A cancel or delete answered with status 200 obliges the caller to abort the session with
        cause CANCEL (idempotent: harmless when the session has already ended).
        """
        request = op.request
        if isinstance(request, ItemsLookup):
            return references_reply(self.db, op, request)
        if not isinstance(request, ResponseGet | ResponseDelete | ResponseCancel
                          | ResponseInputItems):
            return self.conversations.handle_op(op, request)
        rid = request.response_id
        row = self._row(rid)
        if row is None:
            return ResponseReply(op.op_id, 404, message=f"No response found with id '{rid}'.")
        match request:
            case ResponseGet():
                return ResponseReply(op.op_id, 200, response=stored_response(row))
            case ResponseInputItems(page=page):
                return items_reply(op.op_id, rid, page, row["input_items"])
            case ResponseDelete():
                return self._delete(op.op_id, row, running)
        return self._cancel_op(op.op_id, row)

    def _row(self, rid: str) -> Any:
        return self.db.execute("SELECT * FROM responses WHERE id = ?", (rid,)).one()

    def _is_live(self, row: Any, running: bool) -> bool:
        """Whether a session somewhere still runs this row (only placeholders can be live)."""
        if row["status"] not in PLACEHOLDER_STATUSES:
            return False
        owner = row["owner"]
        if owner is None or owner == self.replica_id:
            # A placeholder that no session of ours owns is a crash leftover.
            return running or row["id"] in self.placeholders
        lease = self.db.execute("SELECT lease_until FROM replicas WHERE replica_id = ?",
                                 (owner,)).one()
        return lease is not None and lease["lease_until"] >= self.clock()

    def _delete(self, op_id: str, row: Any, running: bool) -> ResponseReply:
        """A live background response is cancelled, then deleted (as OpenAI does): the caller
        aborts its session here, as for a cancel; another replica's owner is asked to. A live
        foreground one is refused: its own client is still reading it."""
        rid = row["id"]
        if self._is_live(row, running):
            if not row["background"]:
                return ResponseReply(
                    op_id, 400,
                    message=f"Cannot delete response '{rid}' while it is {row['status']}; wait "
                    "for it to finish.",
                )
            self._cancel_row(rid, row["owner"])
        self.placeholders.discard(rid)
        self.db.execute("DELETE FROM responses WHERE id = ?", (rid,))
        return ResponseReply(op_id, 200, deleted=True)

    def _cancel_op(self, op_id: str, row: Any) -> ResponseReply:
        rid = row["id"]
        if not row["background"]:
            return ResponseReply(
                op_id, 400,
                message=f"Cannot cancel response '{rid}': only background responses can be "
                "cancelled.",
            )
        status = row["status"]
        if status in PLACEHOLDER_STATUSES:
            self._cancel_row(rid, row["owner"])
            cancelled = self._row(rid)
            assert cancelled is not None
            row = cancelled
        elif status != ResponseStatus.CANCELLED:
            return ResponseReply(op_id, 400, message=f"Cannot cancel a response that is {status}.")
        return ResponseReply(op_id, 200, response=stored_response(row))

    def _cancel_row(self, rid: str, owner: str | None) -> None:
        """Mark it cancelled; a response another replica runs is left as a request for it."""
        self.cancel(rid)
        if owner is not None and owner != self.replica_id:
            self._request_cancel(rid, owner)

    def _request_cancel(self, rid: str, owner: str) -> None:
        with self.db.transaction() as tx:
            tx.execute("INSERT INTO cancel_requests (response_id, owner, requested_at) VALUES "
                       "(?, ?, ?) ON CONFLICT (response_id) DO NOTHING",
                       (rid, owner, self.clock()))
            self.db.notify(tx, owner)
