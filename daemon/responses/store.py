"""The Responses-API store: stored responses and their conversations, in a database chosen by
URL (daemon/responses/db.py: SQLite by default, PostgreSQL shared by replicas).

The daemon owns it because only the daemon knows when a response ends; the engine and the server
reach it through daemon/responses/lifecycle.py (`Responses`), never directly, and only the
responses room's thread (store_thread.py) calls it. The life of a row:

- ``begin`` writes a placeholder when the Submit is admitted: ``in_progress``, or ``queued`` for
  a background response. A response with ``store: false`` gets no row (background implies store).
- the session then ends in exactly one of: ``complete`` (completed / incomplete), ``fail``,
  ``cancel`` (background cancel: the row stays, ``cancelled``) or ``remove`` (foreground abort:
  the client is gone and nobody will ask for it, so the row goes).
- only placeholders move: once a row is terminal, a late ``complete`` or ``fail`` is ignored, so a
  cancelled response stays cancelled however the race with its last tick goes.
- a DELETE removes the row whatever its state, except a live foreground one (its client is still
  reading it): a live background response is cancelled first, as a cancel would.

Each row records its ``size`` (the bytes of its text), so that the watcher's prune bounds the
store by bytes as well as by count and age, fairly between tenants (daemon/responses/
retention.py), and ``text_bytes``, the bytes of message text its conversation and output render:
a turn whose history cannot fit the context (`ContextBytes`) is refused before it is read.

Rows keep the whole conversation (history included, instructions excluded, as OpenAI does not
carry instructions over ``previous_response_id``), so a chain is one lookup however long it is,
and pruning an old link does not break the responses that continued it. A turn on a conversation
(daemon/responses/conversations.py) claims it with its placeholder and, only if it completes,
adds its input and output items to it in the transaction that completes the row.

Replicas sharing one store: a row names its ``owner`` (the replica running it). Any replica can
read, delete, continue or cancel any row; a cancel (or delete) of a response that runs elsewhere
is marked in the row and left as a request for its owner, whose watcher
(daemon/responses/watcher.py) hands it to the tick through ``take_cancels``. A replica whose
lease runs out has its unfinished rows ended by the next replica's watcher.
"""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon.rejected import ContextBytes
from daemon.responses.conversations import (
    ConversationCounts,
    ConversationLimits,
    Conversations,
    ItemRow,
    Turn,
    output_row,
    turn_of,
)
from daemon.responses.db import Database, Executor, StoreError, connect
from daemon.responses.item_index import index_items
from daemon.responses.ops import StoreOps
from daemon.responses.rows import (
    PLACEHOLDERS_SQL,
    from_text_column,
    json_text,
    messages_decoder,
    row_size,
    text_bytes,
    text_column,
)
from daemon.responses.schema import SCHEMA_VERSION
from daemon.responses.watcher import Watcher
from ipc.records import Message, ResponseFields, Submit, Usage
from ipc.response_records import (
    PLACEHOLDER_STATUSES,
    ResponseOp,
    ResponseReply,
    ResponseStatus,
)

__all__ = ["CRASHED_MESSAGE", "SCHEMA_VERSION", "ResponseStore", "StoreError",
           "previous_not_found"]

CRASHED_MESSAGE = "The server restarted before this response finished."
DEFAULT_LEASE_S = 10.0
DEFAULT_MAX_BYTES = 1 << 30

_PLACEHOLDERS_SQL = PLACEHOLDERS_SQL



def previous_not_found(previous_response_id: str) -> str:
    """The error for a Submit whose ``previous_response_id`` is unknown (or still running)."""
    return f"Previous response with id '{previous_response_id}' not found."


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _fields(submit: Submit) -> ResponseFields:
    if submit.response is None:
        raise ValueError(f"Submit {submit.rid!r} of kind {submit.kind} has no response fields")
    return submit.response


class ResponseStore:
    """The store backend behind `Responses` (lifecycle.py); used from the store thread only
    (store_thread.py), and before it starts.

    ``target``: None (SQLite in memory), a Path (a SQLite file) or a URL (``sqlite:///path``,
    ``postgresql://…``). ``replica_id`` names this replica in the rows it owns.
    """

    def __init__(
        self,
        target: Path | str | None,
        max_count: int,
        max_age_s: float,
        clock: Callable[[], float] = time.time,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        replica_id: str = "local",
        lease_s: float = DEFAULT_LEASE_S,
        conversations: ConversationLimits = ConversationLimits(),  # noqa: B008 (frozen)
    ) -> None:
        self.max_count = max_count
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self.replica_id = replica_id
        self.lease_s = lease_s
        self._clock = clock
        self.db: Database = connect(target)
        self._db = self.db
        self._cancels: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._watcher: Watcher | None = None
        # Rows this process began and has not ended: counted here so Stats costs no query.
        self._placeholders: set[str] = set()
        # The turn `conversation` built, kept for the `begin` of the same submit that follows it
        # in admission: one history lookup per response, not two.
        self._last_turn: tuple[Submit, list[Message]] | None = None
        self.counts = ConversationCounts()
        self.conversations = Conversations(self._db, conversations, clock, self.counts, _new_id)
        # Turns on a conversation this process began and has not ended: what joins it if they
        # complete.
        self._turns: dict[str, Turn] = {}
        self._ops = StoreOps(self._db, replica_id, clock, self._placeholders, self.cancel,
                             self.conversations)

    # --- the engine's side: one session's life ------------------------------------------------

    def conversation(self, submit: Submit, bound: ContextBytes | None = None
                     ) -> list[Message] | None:
        """Messages to render for this response: instructions, history, then the new input.

        None when ``previous_response_id`` is unknown (answer with ``previous_not_found``);
        Rejected, unread, when the history's text and the request's cannot fit ``bound``.
        """
        fields = _fields(submit)
        turn = self._turn(fields, bound)
        if turn is None:
            return None
        self._last_turn = (submit, turn)
        head = [Message("system", fields.instructions)] if fields.instructions else []
        return head + turn

    def begin(self, submit: Submit) -> None:
        """The placeholder row; nothing for ``store: false`` unless background."""
        fields = _fields(submit)
        if not (fields.store or fields.background):
            return
        last, self._last_turn = self._last_turn, None
        turn = last[1] if last is not None and last[0] is submit else self._turn(fields)
        if turn is None:
            raise ValueError(previous_not_found(fields.previous_response_id or ""))
        on = None if fields.conversation is None else turn_of(submit.rid, fields)
        with self._db.transaction() as tx:  # the claim, the placeholder, its index, or none
            if on is not None:
                self.conversations.claim(tx, on, submit.rid)
            self._insert(tx, submit, turn)
            index_items(tx, submit.rid, fields.input_items)
        if on is not None:
            self._turns[submit.rid] = on
        self._placeholders.add(submit.rid)

    def _insert(self, executor: Executor, submit: Submit, turn: list[Message]) -> None:
        fields = _fields(submit)
        now = self._clock()
        status = ResponseStatus.QUEUED if fields.background else ResponseStatus.IN_PROGRESS
        instructions, messages = text_column(fields.instructions), json_text(turn)
        inserted = executor.execute(
            "INSERT INTO responses (id, status, created_at, stored_at, model, instructions,"
            " previous_response_id, background, input_items, messages, temperature, top_p,"
            " max_output_tokens, owner, size, conversation_id, echo, tool_call_format, tenant,"
            " text_bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (id) DO NOTHING",
            (submit.rid, status.value, fields.created_at or int(now), now, fields.model,
             instructions, fields.previous_response_id, int(fields.background),
             fields.input_items, messages, submit.sampling.temperature,
             submit.sampling.top_p, submit.sampling.max_tokens, self.replica_id,
             row_size(fields.input_items, messages, instructions, fields.echo),
             fields.conversation, fields.echo,
             None if fields.tool_call_format is None else fields.tool_call_format.value,
             fields.tenant, text_bytes(turn)),
        ).rowcount
        if inserted != 1:
            raise ValueError(f"response id {submit.rid!r} is already stored")

    def start(self, rid: str) -> None:
        """A queued (background) response got its first tick: in progress."""
        self._db.execute("UPDATE responses SET status = ? WHERE id = ? AND status = ?",
                         (ResponseStatus.IN_PROGRESS.value, rid, ResponseStatus.QUEUED.value))

    def history(self, previous_response_id: str, bound: ContextBytes | None = None,
                adding: int = 0) -> list[Message] | None:
        """The whole conversation up to and including that response's output.

        None when the id is unknown, or still queued / in progress (its output does not exist).
        Rejected, unread, when its text and the turn's own (``adding`` bytes) cannot fit
        ``bound``.
        """
        head = self._db.execute("SELECT status, text_bytes FROM responses WHERE id = ?",
                                (previous_response_id,)).one()
        if head is None or head["status"] in PLACEHOLDER_STATUSES:
            return None
        holds = head["text_bytes"] + adding
        if bound is not None and holds > bound.max_bytes:
            raise bound.refusal("the conversation (previous_response_id's history and input)",
                                holds, "previous_response_id",
                                "start a new conversation without previous_response_id")
        row = self._db.execute("SELECT messages, output_text FROM responses WHERE id = ?",
                               (previous_response_id,)).one()
        if row is None:  # deleted in between (another replica)
            return None
        messages = messages_decoder.decode(row["messages"])
        if row["output_text"] is not None:
            messages.append(Message("assistant", from_text_column(row["output_text"]) or ""))
        return messages

    def complete(
        self, rid: str, output_text: str, usage: Usage, *, incomplete_reason: str | None = None
    ) -> bool:
        """Completed; or incomplete when ``incomplete_reason`` is given (``max_output_tokens``).
        False when the row had ended already (cancelled or deleted meanwhile): nothing stored."""
        status = ResponseStatus.COMPLETED if incomplete_reason is None else ResponseStatus.INCOMPLETE
        return self._end(rid, status, output_row(rid, output_text, status.value),
                  len(output_text.encode()), output_text=text_column(output_text),
                  usage=json_text(usage), incomplete_reason=incomplete_reason,
                  completed_at=self._clock())

    def fail(self, rid: str, message: str) -> None:
        self._end(rid, ResponseStatus.FAILED, error=text_column(message))

    def cancel(self, rid: str) -> None:
        """Background cancel: the row stays, ``cancelled``, whatever arrives later."""
        self._end(rid, ResponseStatus.CANCELLED)

    def remove(self, rid: str) -> None:
        """Foreground abort: the placeholder goes. A terminal row (a cancelled one) is kept."""
        self._settle(rid, f"DELETE FROM responses WHERE id = ? AND status IN {_PLACEHOLDERS_SQL}",
                     (rid,))

    def num_placeholders(self) -> int:
        return len(self._placeholders)

    def _turn(self, fields: ResponseFields, bound: ContextBytes | None = None
              ) -> list[Message] | None:
        """History, then this request's input: what the row stores (no instructions)."""
        history: list[Message] | None = []
        own = text_bytes(fields.input) + len((fields.instructions or "").encode())
        if fields.previous_response_id is not None:
            history = self.history(fields.previous_response_id, bound, own)
        elif fields.conversation is not None:
            history = self.conversations.history(fields.conversation, bound, own)
        if history is None:
            return None
        return history + fields.input

    def _end(self, rid: str, status: ResponseStatus, output: ItemRow | None = None,
             output_bytes: int = 0, **columns: Any) -> bool:
        sets = "".join(f", {name} = ?" for name in columns)
        return self._settle(rid, f"UPDATE responses SET status = ?, size = size + ?, text_bytes = "
                     f"text_bytes + ?{sets} WHERE id = ? AND status IN {_PLACEHOLDERS_SQL}",
                     (status.value, row_size(*columns.values()), output_bytes,
                      *columns.values(), rid), output)

    def _settle(self, rid: str, sql: str, params: tuple[Any, ...],
                output: ItemRow | None = None) -> bool:
        """Ends a placeholder with ``sql`` (only a placeholder moves); whether it moved. A turn
        on a conversation lets its claim go in the same transaction, and its items join the
        conversation there if it completed right here (``output``: its output item)."""
        self._placeholders.discard(rid)
        turn = self._turns.pop(rid, None)
        if turn is None:
            return self._db.execute(sql, params).rowcount == 1
        with self._db.transaction() as tx:
            moved = tx.execute(sql, params).rowcount == 1
            self.conversations.release(tx, turn, rid, output if moved else None)
        self.conversations.recount(self._db)
        return moved

    # --- the proxy's side: GET / DELETE / cancel, in daemon/responses/ops.py --------------------

    def handle_op(self, op: ResponseOp, running: bool) -> ResponseReply:
        """Answer one ResponseOp (daemon/responses/ops.py). ``running``: the engine holds a live
        session for this id.

        A CANCEL or DELETE answered with status 200 obliges the caller to abort the session with
        cause CANCEL (idempotent: harmless when the session has already ended).
        """
        return self._ops.handle_op(op, running)

    # --- replicas: the cancel channel and the lease ---------------------------------------------

    def take_cancels(self) -> list[str]:
        """Responses of ours cancelled through another replica since the last call (no I/O)."""
        out: list[str] = []
        while True:
            try:
                out.append(self._cancels.get_nowait())
            except queue.Empty:
                return out

    def watcher(self, db: Database | None = None) -> Watcher:
        """This replica's housekeeping on ``db`` (default: this store's own connection)."""
        db = db or self._db
        return Watcher(db, self.replica_id, self.lease_s, self._cancels,
                       max_count=self.max_count, max_age_s=self.max_age_s,
                       max_bytes=self.max_bytes, clock=self._clock,
                       conversations=Conversations(db, self.conversations.limits, self._clock,
                                                   self.counts, _new_id))

    def start_watching(self) -> None:
        """Take the lease and run the housekeeping in its own thread, on its own connection."""
        self._watcher = self.watcher(self._db.for_thread())
        self._watcher.start()

    # --- housekeeping -------------------------------------------------------------------------

    def cleanup_crashed(self) -> int:
        """At startup: end the placeholders a previous run of this replica left behind.

        Foreground ones are deleted (their client is long gone); background ones become
        ``failed`` so that a client polling them sees an end rather than a 404. Rows of other
        replicas are theirs (or their lease's) to end.
        """
        rows = self._db.execute(
            f"SELECT id, background FROM responses WHERE status IN {_PLACEHOLDERS_SQL} "
            "AND (owner = ? OR owner IS NULL)", (self.replica_id,)
        ).rows
        orphans = [r for r in rows if r["id"] not in self._placeholders]
        for row in orphans:
            if row["background"]:
                self._end(row["id"], ResponseStatus.FAILED, error=text_column(CRASHED_MESSAGE))
            else:
                self.remove(row["id"])
        return len(orphans)

    def prune(self) -> int:
        """Drop finished responses beyond ``max_age_s``, ``max_count`` or ``max_bytes`` (oldest
        first).

        The watcher runs it every few seconds, off the tick."""
        return self.watcher().prune()

    def conversation_counts(self) -> tuple[int, int]:
        """Conversations and their items in the store, as last counted (no I/O)."""
        return self.counts.conversations, self.counts.items

    def num_stored(self) -> int:
        return int(self._db.execute("SELECT count(*) AS n FROM responses").one()["n"])

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            try:
                self._watcher.release()
            except Exception:  # a store already gone: the lease runs out by itself
                pass
            self._watcher.db.close()
            self._watcher = None
        self._db.close()
