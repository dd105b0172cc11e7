"""Conversations (OpenAI's Conversations API) in the response store: durable, shared by replicas
through it, never half-written.

A conversation is a row (its metadata, how many items it holds and their bytes, the turn running
on it) and its items, each at its position ``seq``: the item as the proxy validated it (listed
back as stored) and the messages it renders as in a prompt (a turn's history is their
concatenation, so the daemon never re-reads an item's fields).

A Responses turn on a conversation (`ResponseFields.conversation`) claims it when its placeholder
is written (`claim`, in the same transaction): ``running_response_id`` names the turn, and a
second turn while that one is still a placeholder is refused with a 409 that names it. The turn's
input items and its output join the conversation only when it completes (`append`, in the
transaction that completes its row); however else it ends, nothing is added and the claim is let
go (`release`). A claim whose response is no longer a placeholder (a crash, a replica whose lease
ran out) is stale, and the next turn takes it over.

Retention: the watcher prunes the conversations touched least recently beyond a count, an age and
a total of bytes, fairly between tenants (daemon/responses/retention.py); one conversation holds
at most ``max_items`` items. A conversation counts the bytes of text its items render
(``text_bytes``), so that a turn on one whose history cannot fit the context is refused before a
byte of it is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import msgspec

from daemon.rejected import ContextBytes, Rejected
from daemon.responses.db import Database, Executor
from daemon.responses.items import PAGE_BYTES, listed_ids, within_bytes
from daemon.responses.retention import fair_prune
from daemon.responses.rows import PLACEHOLDERS_SQL, json_text, messages_decoder, text_bytes
from ipc.records import Message, ResponseFields
from ipc.response_records import (
    ConversationCreate,
    ConversationDelete,
    ConversationGet,
    ConversationItemDelete,
    ConversationItemGet,
    ConversationItems,
    ConversationItemsAdd,
    ConversationItemsList,
    ConversationRequest,
    ConversationUpdate,
    ItemsPage,
    ResponseOp,
    ResponseReply,
    StoredConversation,
)

# Ids made for items sent without one, by item type (OpenAI's prefixes).
_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


@dataclasses.dataclass(frozen=True, slots=True)
class ConversationLimits:
    max_count: int = 10_000
    max_age_s: float = 30 * 24 * 3600.0  # since a conversation last changed
    max_bytes: int = 1 << 30
    max_items: int = 10_000  # in one conversation


@dataclasses.dataclass(slots=True)
class ConversationCounts:
    """The store's figures for /metrics, as last counted (by the watcher, and after a change)."""

    conversations: int = 0
    items: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ItemRow:
    item_id: str
    item: str  # JSON text, as validated
    messages: str  # JSON text of the list of messages it renders as
    text_bytes: int = 0  # the bytes of text those messages render (rows.text_bytes)

    @property
    def size(self) -> int:
        return len(self.item.encode()) + len(self.messages.encode())


@dataclasses.dataclass(frozen=True, slots=True)
class Turn:
    """A response running on a conversation: what joins it if the response completes."""

    conversation_id: str
    input: list[ItemRow]


class _Head(msgspec.Struct):
    id: Any = None
    type: Any = "message"


_raw_items = msgspec.json.Decoder(list[msgspec.Raw])
_heads = msgspec.json.Decoder(list[_Head])
_metadata = msgspec.json.Decoder(dict[str, str])


def not_found(conversation_id: str) -> str:
    return f"Conversation with id '{conversation_id}' not found."


def _rows(items: str, ids: list[str], messages: list[list[Message]]) -> list[ItemRow]:
    raws = _raw_items.decode(items.encode())
    if not len(raws) == len(ids) == len(messages):
        raise Rejected(f"{len(raws)} items arrived with {len(messages)} renderings",
                       param="items")
    return [ItemRow(i, bytes(raw).decode(), json_text(m), text_bytes(m))
            for i, raw, m in zip(ids, raws, messages, strict=True)]


def new_rows(items: ConversationItems, make_id: Callable[[str], str]) -> list[ItemRow]:
    """Items added through the Conversations API: an item without an id gets a new one."""
    ids = [h.id if isinstance(h.id, str) and h.id else
           make_id(_PREFIXES.get(h.type, "item") if isinstance(h.type, str) else "item")
           for h in _heads.decode(items.items.encode())]
    return _rows(items.items, ids, items.messages)


def turn_of(rid: str, fields: ResponseFields) -> Turn:
    """A turn's input items, under the ids its response lists them by; each with its messages
    (`input_spans` of the turn's `input`)."""
    assert fields.conversation is not None
    spans, groups, start = fields.input_spans, [], 0
    if sum(spans) != len(fields.input):
        raise Rejected(f"input_spans cover {sum(spans)} of {len(fields.input)} messages",
                       param="input")
    for span in spans:
        groups.append(fields.input[start:start + span])
        start += span
    ids = listed_ids(rid, fields.input_items.encode())
    return Turn(fields.conversation, _rows(fields.input_items, ids, groups))


def output_row(rid: str, text: str, status: str) -> ItemRow:
    """A turn's output message, under the id its response gives it."""
    item = {"type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text}]}
    return ItemRow("msg_" + rid.removeprefix("resp_"), json_text(item),
                   json_text([Message("assistant", text)]), len(text.encode()))


class Conversations:
    """The conversations of one store connection; every method is one or a few statements."""

    def __init__(self, db: Database, limits: ConversationLimits, clock: Callable[[], float],
                 counts: ConversationCounts, make_id: Callable[[str], str]) -> None:
        self.db = db
        self.limits = limits
        self.clock = clock
        self.counts = counts
        self.make_id = make_id
        # PostgreSQL: lock the conversation's row for the transaction (a SQLite transaction
        # holds the write lock from its start).
        self._lock = " FOR UPDATE" if db.dialect == "postgresql" else ""

    # --- a Responses turn ---------------------------------------------------------------------

    def history(self, conversation_id: str, bound: ContextBytes | None = None,
                adding: int = 0) -> list[Message] | None:
        """Its items' messages in order; None when there is no such conversation. Refused
        unread when their text and the turn's own (``adding`` bytes) cannot fit ``bound``."""
        row = self._row(self.db, conversation_id)
        if row is None:
            return None
        holds = row["text_bytes"] + adding
        if bound is not None and holds > bound.max_bytes:
            raise bound.refusal(f"conversation '{conversation_id}' with this turn's input",
                                holds, "conversation", "start a new conversation")
        out: list[Message] = []
        for row in self.db.execute("SELECT messages FROM conversation_items WHERE "
                                   "conversation_id = ? ORDER BY seq", (conversation_id,)).rows:
            out += messages_decoder.decode(row["messages"])
        return out

    def claim(self, tx: Executor, turn: Turn, rid: str) -> None:
        """Names ``rid`` as the turn running on the conversation, or refuses it: 404, 409 while
        another turn runs, 400 past ``max_items``."""
        cid = turn.conversation_id
        row = self._row(tx, cid, lock=True)
        if row is None:
            raise Rejected(not_found(cid), status=404, param="conversation", code="not_found")
        running = row["running_response_id"]
        if running is not None and running != rid and tx.execute(
                f"SELECT id FROM responses WHERE id = ? AND status IN {PLACEHOLDERS_SQL}",
                (running,)).one() is not None:
            raise Rejected(f"Conversation '{cid}' is running response '{running}'; send the "
                           "next turn once it has finished.", status=409, param="conversation",
                           code="conversation_locked")
        self._check_room(row, cid, len(turn.input) + 1)
        tx.execute("UPDATE conversations SET running_response_id = ?, updated_at = ? WHERE id = ?",
                   (rid, self.clock(), cid))

    def release(self, tx: Executor, turn: Turn, rid: str, output: ItemRow | None) -> None:
        """The turn ended: with ``output`` (it completed) its items join the conversation."""
        if output is not None and self._row(tx, turn.conversation_id, lock=True) is not None:
            self._append(tx, turn.conversation_id, [*turn.input, output])
        tx.execute("UPDATE conversations SET running_response_id = NULL WHERE id = ? AND "
                   "running_response_id = ?", (turn.conversation_id, rid))

    # --- the Conversations API --------------------------------------------------------------

    def handle_op(self, op: ResponseOp, request: ConversationRequest) -> ResponseReply:
        """Answers one of ``op``'s conversation requests; what the client asked wrongly is its
        status."""
        try:
            return self._handle(op, request)
        except Rejected as e:
            return ResponseReply(op.op_id, e.status, message=e.message, param=e.param)

    def _handle(self, op: ResponseOp, request: ConversationRequest) -> ResponseReply:
        if isinstance(request, ConversationCreate):
            return self._create(op, request)
        cid = request.conversation_id
        row = self._row(self.db, cid)
        if row is None:
            return ResponseReply(op.op_id, 404, message=not_found(cid))
        match request:
            case ConversationGet():
                return self._reply(op, row)
            case ConversationItemsList(page=page):
                return self._page(op, cid, page)
            case ConversationItemGet(item_id=item_id):
                return self._item(op, cid, item_id)
        with self.db.transaction() as tx:
            reply = self._change(tx, op, request)
        self.recount(self.db)
        return reply

    def _create(self, op: ResponseOp, request: ConversationCreate) -> ResponseReply:
        now, cid = self.clock(), request.conversation_id
        rows = new_rows(request.items, self.make_id) if request.items is not None else []
        with self.db.transaction() as tx:
            tx.execute("INSERT INTO conversations (id, created_at, updated_at, metadata, tenant) "
                       "VALUES (?, ?, ?, ?, ?)", (cid, int(now), now,
                                                 json_text(request.metadata), op.tenant))
            row = self._row(tx, cid)
            self._check_room(row, cid, len(rows))
            self._append(tx, cid, rows)
        self.recount(self.db)
        return ResponseReply(op.op_id, 200, conversation=StoredConversation(
            cid, int(now), request.metadata))

    def _change(self, tx: Executor, op: ResponseOp, request: ConversationUpdate
                | ConversationDelete | ConversationItemsAdd | ConversationItemDelete
                ) -> ResponseReply:
        cid = request.conversation_id
        row = self._row(tx, cid, lock=True)
        if row is None:
            return ResponseReply(op.op_id, 404, message=not_found(cid))
        match request:
            case ConversationDelete():
                tx.execute("DELETE FROM conversation_items WHERE conversation_id = ?", (cid,))
                tx.execute("DELETE FROM conversations WHERE id = ?", (cid,))
                return ResponseReply(op.op_id, 200, deleted=True)
            case ConversationUpdate(metadata=metadata):
                tx.execute("UPDATE conversations SET metadata = ?, updated_at = ? WHERE id = ?",
                           (json_text(metadata), self.clock(), cid))
            case ConversationItemsAdd(items=items):
                rows = new_rows(items, self.make_id)
                self._check_room(row, cid, len(rows))
                self._append(tx, cid, rows)
                # The ids alone: the proxy lists the items it sent (an echo would cost the
                # tokens pipe their size again, and a stream behind it its pace).
                return ResponseReply(op.op_id, 200, item_ids=[r.item_id for r in rows])
            case ConversationItemDelete(item_id=item_id):
                if not self._delete_item(tx, cid, item_id):
                    return ResponseReply(op.op_id, 404,
                                         message=f"Item with id '{item_id}' not found.")
        return self._reply(op, self._row(tx, cid))

    def _delete_item(self, tx: Executor, cid: str, item_id: str) -> bool:
        gone = tx.execute("SELECT count(*) AS n, coalesce(sum(size), 0) AS size, "
                          "coalesce(sum(text_bytes), 0) AS text_bytes FROM conversation_items "
                          "WHERE conversation_id = ? AND item_id = ?", (cid, item_id)).one()
        if not gone["n"]:
            return False
        tx.execute("DELETE FROM conversation_items WHERE conversation_id = ? AND item_id = ?",
                   (cid, item_id))
        tx.execute("UPDATE conversations SET num_items = num_items - ?, size = size - ?, "
                   "text_bytes = text_bytes - ?, updated_at = ? WHERE id = ?",
                   (gone["n"], gone["size"], gone["text_bytes"], self.clock(), cid))
        return True

    def _page(self, op: ResponseOp, cid: str, page: ItemsPage) -> ResponseReply:
        asc = page.order == "asc"
        bound = -1 if asc else 2**62
        if page.after is not None:
            row = self.db.execute("SELECT min(seq) AS seq FROM conversation_items WHERE "
                                  "conversation_id = ? AND item_id = ?", (cid, page.after)).one()
            if row is None or row["seq"] is None:
                return ResponseReply(op.op_id, 400, param="after", message=f"'after' names no "
                                     f"item of conversation {cid!r}: {page.after!r}")
            bound = row["seq"]
        # The page's sizes first (an item's `size` bounds its bytes): a page ends where its
        # items would pass PAGE_BYTES, so only what goes out is read, and the reply fits a frame.
        sizes = self.db.execute(
            f"SELECT seq, size FROM conversation_items WHERE conversation_id = ? AND seq "
            f"{'>' if asc else '<'} ? ORDER BY seq {'ASC' if asc else 'DESC'} LIMIT ?",
            (cid, bound, page.limit + 1)).rows
        chosen = within_bytes([r["size"] for r in sizes[:page.limit]], PAGE_BYTES)
        if not chosen:
            return self._listing(op, [], has_more=False)
        seqs = [r["seq"] for r in sizes[:chosen]]
        rows = self.db.execute(
            "SELECT item_id, item FROM conversation_items WHERE conversation_id = ? AND seq "
            f"BETWEEN ? AND ? ORDER BY seq {'ASC' if asc else 'DESC'}",
            (cid, min(seqs), max(seqs))).rows
        items = [ItemRow(r["item_id"], r["item"], "") for r in rows]
        return self._listing(op, items, has_more=len(sizes) > chosen)

    def _item(self, op: ResponseOp, cid: str, item_id: str) -> ResponseReply:
        row = self.db.execute("SELECT item_id, item FROM conversation_items WHERE "
                              "conversation_id = ? AND item_id = ? ORDER BY seq LIMIT 1",
                              (cid, item_id)).one()
        if row is None:
            return ResponseReply(op.op_id, 404, message=f"Item with id '{item_id}' not found.")
        return self._listing(op, [ItemRow(row["item_id"], row["item"], "")], False)

    # --- housekeeping ---------------------------------------------------------------------------

    def prune(self) -> int:
        """Drop the conversations beyond the age, count and bytes bounds, least recently
        changed first and fairly between tenants (retention.py); then their items."""
        limits = self.limits
        with self.db.transaction() as tx:
            n = tx.execute("DELETE FROM conversations WHERE updated_at < ?",
                           (self.clock() - limits.max_age_s,)).rowcount
            n += fair_prune(tx, "conversations", "updated_at", "TRUE", limits.max_count,
                            limits.max_bytes)
            if n:
                tx.execute("DELETE FROM conversation_items WHERE NOT EXISTS (SELECT 1 FROM "
                           "conversations c WHERE c.id = conversation_items.conversation_id)")
        self.recount(self.db)
        return n

    def recount(self, executor: Executor) -> None:
        row = executor.execute("SELECT count(*) AS n, coalesce(sum(num_items), 0) AS items FROM "
                               "conversations").one()
        self.counts.conversations, self.counts.items = int(row["n"]), int(row["items"])

    # --- plumbing -------------------------------------------------------------------------------

    def _row(self, executor: Executor, cid: str, lock: bool = False) -> Any:
        return executor.execute("SELECT * FROM conversations WHERE id = ?"
                                + (self._lock if lock else ""), (cid,)).one()

    def _check_room(self, row: Any, cid: str, adding: int) -> None:
        if row["num_items"] + adding > self.limits.max_items:
            raise Rejected(f"Conversation '{cid}' holds {row['num_items']} items; {adding} more "
                           f"would pass its bound of {self.limits.max_items}", param="items",
                           code="conversation_full")

    def _append(self, tx: Executor, cid: str, rows: list[ItemRow]) -> None:
        if not rows:
            return
        first = self._row(tx, cid)["next_seq"]
        for seq, row in enumerate(rows, start=first):
            tx.execute("INSERT INTO conversation_items (conversation_id, seq, item_id, item, "
                       "messages, size, text_bytes) VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (cid, seq, row.item_id, row.item, row.messages, row.size, row.text_bytes))
        tx.execute("UPDATE conversations SET next_seq = next_seq + ?, num_items = num_items + ?,"
                   " size = size + ?, text_bytes = text_bytes + ?, updated_at = ? WHERE id = ?",
                   (len(rows), len(rows), sum(r.size for r in rows),
                    sum(r.text_bytes for r in rows), self.clock(), cid))

    def _reply(self, op: ResponseOp, row: Any) -> ResponseReply:
        return ResponseReply(op.op_id, 200, conversation=StoredConversation(
            row["id"], row["created_at"], _metadata.decode(row["metadata"])))

    @staticmethod
    def _listing(op: ResponseOp, rows: list[ItemRow], has_more: bool) -> ResponseReply:
        return ResponseReply(op.op_id, 200, input_items="[" + ",".join(r.item for r in rows) + "]",
                             item_ids=[r.item_id for r in rows], has_more=has_more)
