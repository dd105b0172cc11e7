"""The Responses-API store: stored responses and their conversations, in SQLite.

The daemon owns it because only the daemon knows when a response ends. The lifecycle of a row:

- ``begin`` writes a placeholder when the Submit is admitted: ``in_progress``, or ``queued`` for
  a background response. A response with ``store: false`` gets no row (background implies store).
- the session then ends in exactly one of: ``complete`` (completed / incomplete), ``fail``,
  ``cancel`` (background cancel: the row stays, ``cancelled``) or ``remove`` (foreground abort:
  the client is gone and nobody will ask for it, so the row goes).
- only placeholders move: once a row is terminal, a late ``complete`` or ``fail`` is ignored, so a
  cancelled response stays cancelled however the race with its last tick goes.

Rows keep the whole conversation (history included, instructions excluded, as OpenAI does not
carry instructions over ``previous_response_id``), so a chain is one lookup however long it is,
and pruning an old link does not break the responses that continued it.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from ipc.records import (
    Message,
    ResponseFields,
    ResponseOp,
    ResponseOpKind,
    ResponseReply,
    Submit,
    Usage,
)
from ipc.response_object import (
    PLACEHOLDER_STATUSES,
    ResponseStatus,
    build_response,
    input_item_objects,
    input_items_to_messages,
)

SCHEMA_VERSION = 1

# Pruning costs two indexed DELETEs; every this many stored begins is often enough to stay near
# the bound without paying it per request.
PRUNE_EVERY = 64

CRASHED_MESSAGE = "The server restarted before this response finished."

_PLACEHOLDERS_SQL = "(" + ", ".join(sorted(f"'{s.value}'" for s in PLACEHOLDER_STATUSES)) + ")"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    stored_at REAL NOT NULL,
    completed_at REAL,
    model TEXT NOT NULL,
    instructions TEXT,
    previous_response_id TEXT,
    background INTEGER NOT NULL,
    input_items TEXT NOT NULL,
    messages TEXT NOT NULL,
    output_text TEXT,
    usage TEXT,
    error TEXT,
    incomplete_reason TEXT,
    temperature REAL,
    top_p REAL,
    max_output_tokens INTEGER
);
CREATE INDEX IF NOT EXISTS responses_stored_at ON responses (stored_at);
"""

_messages_decoder = msgspec.json.Decoder(list[Message])
_usage_decoder = msgspec.json.Decoder(Usage)


class StoreError(Exception):
    """The store file cannot be used; the message names the path and the reason."""


def previous_not_found(previous_response_id: str) -> str:
    """The error for a Submit whose ``previous_response_id`` is unknown (or still running)."""
    return f"Previous response with id '{previous_response_id}' not found."


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def _fields(submit: Submit) -> ResponseFields:
    if submit.response is None:
        raise ValueError(f"Submit {submit.rid!r} of kind {submit.kind} has no response fields")
    return submit.response


def _prepare_file(path: Path) -> None:
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True)
    # Owner-only from the first byte: the store holds users' conversations. SQLite gives the
    # -wal and -shm files the mode of the database file.
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))


def _connect(path: Path | None) -> sqlite3.Connection:
    target = ":memory:" if path is None else str(path)
    try:
        if path is not None:
            _prepare_file(path)
        # Autocommit: each statement is its own transaction unless wrapped in BEGIN/COMMIT.
        db = sqlite3.connect(target, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: no fsync per commit; a power cut may lose the last few responses, never
        # corrupt the file.
        db.execute("PRAGMA synchronous=NORMAL")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            db.close()
            raise StoreError(f"response store {target}: schema version {version} is newer than "
                             f"this tether ({SCHEMA_VERSION}); use a newer tether or another "
                             "--state-dir")
        db.executescript(_SCHEMA)
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    except (OSError, sqlite3.Error) as e:
        raise StoreError(f"response store {target}: {e}") from e
    return db


def _body(row: sqlite3.Row) -> dict[str, Any]:
    return build_response(
        id=row["id"],
        status=row["status"],
        created_at=row["created_at"],
        model=row["model"],
        output_text=row["output_text"],
        usage=None if row["usage"] is None else _usage_decoder.decode(row["usage"]),
        instructions=row["instructions"],
        previous_response_id=row["previous_response_id"],
        background=bool(row["background"]),
        store=True,
        error=row["error"],
        incomplete_reason=row["incomplete_reason"],
        temperature=row["temperature"],
        top_p=row["top_p"],
        max_output_tokens=row["max_output_tokens"],
        completed_at=row["completed_at"],
    )


class ResponseStore:
    """One SQLite connection, used from the daemon's tick thread only."""

    def __init__(
        self,
        path: Path | None,
        max_count: int,
        max_age_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.max_count = max_count
        self.max_age_s = max_age_s
        self._clock = clock
        self._db = _connect(path)
        # Rows this process began and has not ended: counted here so Stats costs no query.
        self._placeholders: set[str] = set()
        self._num_begun = 0
        # The turn `conversation` built, kept for the `begin` of the same submit that follows it
        # in admission: one history lookup per response, not two.
        self._last_turn: tuple[Submit, list[Message]] | None = None

    # --- the engine's side: one session's life ------------------------------------------------

    def conversation(self, submit: Submit) -> list[Message] | None:
        """Messages to render for this response: instructions, history, then the new input.

        None when ``previous_response_id`` is unknown (answer with ``previous_not_found``).
        Raises ``ValueError`` (an ``InputError``) on malformed input items.
        """
        fields = _fields(submit)
        turn = self._turn(fields)
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
        now = self._clock()
        status = ResponseStatus.QUEUED if fields.background else ResponseStatus.IN_PROGRESS
        try:
            self._db.execute(
                "INSERT INTO responses (id, status, created_at, stored_at, model, instructions,"
                " previous_response_id, background, input_items, messages, temperature, top_p,"
                " max_output_tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (submit.rid, status.value, fields.created_at or int(now), now, fields.model,
                 fields.instructions, fields.previous_response_id, int(fields.background),
                 _json(fields.input_items), _json(turn), submit.sampling.temperature,
                 submit.sampling.top_p, submit.sampling.max_tokens),
            )
        except sqlite3.IntegrityError as e:
            raise ValueError(f"response id {submit.rid!r} is already stored") from e
        self._placeholders.add(submit.rid)
        self._num_begun += 1
        if self._num_begun % PRUNE_EVERY == 0:
            self.prune()

    def start(self, rid: str) -> None:
        """A queued (background) response got its first tick: in progress."""
        self._db.execute("UPDATE responses SET status = ? WHERE id = ? AND status = ?",
                         (ResponseStatus.IN_PROGRESS.value, rid, ResponseStatus.QUEUED.value))

    def history(self, previous_response_id: str) -> list[Message] | None:
        """The whole conversation up to and including that response's output.

        None when the id is unknown, or still queued / in progress (its output does not exist).
        """
        row = self._db.execute(
            "SELECT status, messages, output_text FROM responses WHERE id = ?",
            (previous_response_id,),
        ).fetchone()
        if row is None or row["status"] in PLACEHOLDER_STATUSES:
            return None
        messages = _messages_decoder.decode(row["messages"])
        if row["output_text"] is not None:
            messages.append(Message("assistant", row["output_text"]))
        return messages

    def complete(
        self, rid: str, output_text: str, usage: Usage, *, incomplete_reason: str | None = None
    ) -> None:
        """Completed; or incomplete when ``incomplete_reason`` is given (``max_output_tokens``)."""
        status = ResponseStatus.COMPLETED if incomplete_reason is None else ResponseStatus.INCOMPLETE
        self._end(rid, status, output_text=output_text, usage=_json(usage),
                  incomplete_reason=incomplete_reason, completed_at=self._clock())

    def fail(self, rid: str, message: str) -> None:
        self._end(rid, ResponseStatus.FAILED, error=message)

    def cancel(self, rid: str) -> None:
        """Background cancel: the row stays, ``cancelled``, whatever arrives later."""
        self._end(rid, ResponseStatus.CANCELLED)

    def remove(self, rid: str) -> None:
        """Foreground abort: the placeholder goes. A terminal row (a cancelled one) is kept."""
        self._placeholders.discard(rid)
        self._db.execute(
            f"DELETE FROM responses WHERE id = ? AND status IN {_PLACEHOLDERS_SQL}", (rid,)
        )

    def num_placeholders(self) -> int:
        return len(self._placeholders)

    def _turn(self, fields: ResponseFields) -> list[Message] | None:
        """History, then this request's input: what the row stores (no instructions)."""
        history: list[Message] | None = []
        if fields.previous_response_id is not None:
            history = self.history(fields.previous_response_id)
        if history is None:
            return None
        return history + input_items_to_messages(fields.input_items, None)

    def _end(self, rid: str, status: ResponseStatus, **columns: Any) -> None:
        self._placeholders.discard(rid)
        sets = "".join(f", {name} = ?" for name in columns)
        self._db.execute(
            f"UPDATE responses SET status = ?{sets} WHERE id = ? AND status IN {_PLACEHOLDERS_SQL}",
            (status.value, *columns.values(), rid),
        )

    # --- the proxy's side: GET / DELETE / cancel ----------------------------------------------

    def handle_op(self, op: ResponseOp, running: bool) -> ResponseReply:
        """Answer one ResponseOp. ``running``: the engine holds a live session for this id.

        A CANCEL answered with status 200 obliges the caller to abort the session with cause
        CANCEL (idempotent: harmless when the session has already ended).
        """
        row = self._row(op.response_id)
        if row is None:
            return ResponseReply(op.op_id, 404,
                                 message=f"No response found with id '{op.response_id}'.")
        if op.op is ResponseOpKind.GET:
            return ResponseReply(op.op_id, 200, body=_body(row))
        if op.op is ResponseOpKind.INPUT_ITEMS:
            items = input_item_objects(op.response_id, msgspec.json.decode(row["input_items"]))
            return ResponseReply(op.op_id, 200, body={"data": items})
        if op.op is ResponseOpKind.DELETE:
            return self._delete(op, row, running)
        return self._cancel_op(op, row)

    def _row(self, rid: str) -> sqlite3.Row | None:
        row: sqlite3.Row | None = self._db.execute(
            "SELECT * FROM responses WHERE id = ?", (rid,)
        ).fetchone()
        return row

    def _delete(self, op: ResponseOp, row: sqlite3.Row, running: bool) -> ResponseReply:
        # Deleting a live response would leave the engine generating for nobody; a placeholder
        # that no session owns is a crash leftover and may go.
        live = running or op.response_id in self._placeholders
        if live and row["status"] in PLACEHOLDER_STATUSES:
            return ResponseReply(
                op.op_id, 400,
                message=f"Cannot delete response '{op.response_id}' while it is "
                f"{row['status']}; cancel it (background) or wait for it to finish.",
            )
        self._db.execute("DELETE FROM responses WHERE id = ?", (op.response_id,))
        body = {"id": op.response_id, "object": "response.deleted", "deleted": True}
        return ResponseReply(op.op_id, 200, body=body)

    def _cancel_op(self, op: ResponseOp, row: sqlite3.Row) -> ResponseReply:
        if not row["background"]:
            return ResponseReply(
                op.op_id, 400,
                message=f"Cannot cancel response '{op.response_id}': only background responses "
                "can be cancelled.",
            )
        status = row["status"]
        if status in PLACEHOLDER_STATUSES:
            self.cancel(op.response_id)
            cancelled = self._row(op.response_id)
            assert cancelled is not None
            row = cancelled
        elif status != ResponseStatus.CANCELLED:
            return ResponseReply(op.op_id, 400,
                                 message=f"Cannot cancel a response that is {status}.")
        return ResponseReply(op.op_id, 200, body=_body(row))

    # --- housekeeping -------------------------------------------------------------------------

    def cleanup_crashed(self) -> int:
        """At startup: end placeholders that a previous run left behind. Returns how many.

        Foreground ones are deleted (their client is long gone); background ones become
        ``failed`` so that a client polling them sees an end rather than a 404.
        """
        rows = self._db.execute(
            f"SELECT id, background FROM responses WHERE status IN {_PLACEHOLDERS_SQL}"
        ).fetchall()
        orphans = [r for r in rows if r["id"] not in self._placeholders]
        for row in orphans:
            if row["background"]:
                self._end(row["id"], ResponseStatus.FAILED, error=CRASHED_MESSAGE)
            else:
                self.remove(row["id"])
        return len(orphans)

    def prune(self) -> int:
        """Drop finished responses beyond ``max_age_s`` or ``max_count`` (oldest first)."""
        cutoff = self._clock() - self.max_age_s
        finished = f"status NOT IN {_PLACEHOLDERS_SQL}"
        self._db.execute("BEGIN")
        try:
            by_age = self._db.execute(
                f"DELETE FROM responses WHERE stored_at < ? AND {finished}", (cutoff,)
            ).rowcount
            by_count = self._db.execute(
                "DELETE FROM responses WHERE rowid IN (SELECT rowid FROM responses WHERE "
                f"{finished} ORDER BY stored_at DESC, rowid DESC LIMIT -1 OFFSET ?)",
                (self.max_count,),
            ).rowcount
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return by_age + by_count

    def num_stored(self) -> int:
        count: int = self._db.execute("SELECT count(*) FROM responses").fetchone()[0]
        return count

    def close(self) -> None:
        self._db.close()
