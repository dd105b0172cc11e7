"""The store's side of a stored response's life, on the store thread (store_thread.py): a turn's
load (its history, its prompts, its placeholder), its first tick, its end, and the ResponseOps.

A failing store costs one session, never the daemon. A store can fail at any call (a full disk,
a read-only database, a lost connection to a database server): a load the store cannot serve is
that request's error; a session that ends while the store cannot record the end still ends (a
completed one's Finish then says why its result was not stored), and the store is asked to mark
the row ``failed`` so that a later GET agrees. Every failure is logged as an error naming the
response; no other session, and not the thread, ever sees the exception.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from daemon.rejected import ContextBytes, Rejected
from daemon.responses.conversations import not_found
from daemon.responses.events import (
    Aborted,
    Completed,
    Ending,
    Failed,
    Loaded,
    Prepare,
    Refused,
    Stored,
)
from daemon.responses.store import previous_not_found
from ipc.records import AbortCause, FinishReason, Message, Submit, Usage
from ipc.response_records import SHUTDOWN_REASON, ResponseOp, ResponseReply

log = logging.getLogger("tether.store")


class Store(Protocol):
    """A store backend: ResponseStore (daemon/responses/store.py), over SQLite or PostgreSQL."""

    def conversation(self, submit: Submit,
                     bound: ContextBytes | None = None) -> list[Message] | None: ...
    def begin(self, submit: Submit) -> None: ...
    def start(self, rid: str) -> None: ...
    def complete(self, rid: str, output_text: str, usage: Usage, *,
                 incomplete_reason: str | None = None) -> bool: ...
    def remove(self, rid: str) -> None: ...
    def cancel(self, rid: str) -> None: ...
    def fail(self, rid: str, message: str) -> None: ...
    def conversation_counts(self) -> tuple[int, int]: ...
    def handle_op(self, op: ResponseOp, running: bool) -> ResponseReply: ...
    def take_cancels(self) -> list[str]: ...


def check_input(messages: list[Message]) -> list[Message]:
    if not any(m.role != "system" for m in messages):
        raise Rejected("input must not be empty", param="input")
    return messages


class Keeper:
    """The store's side of each session; used from the store thread only."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._begun: set[str] = set()  # rows written by a load whose end is not recorded yet
        self._queued: set[str] = set()  # background rows that say queued until a first tick

    # --- a turn's load: a failure is that request's error -------------------------------------

    def load(self, submit: Submit, prepare: Prepare) -> Loaded | Refused:
        """Renders the turn with its stored history (``prepare``) and writes its placeholder:
        as admission did on the tick, in the same order, so nothing is stored for a turn its
        prompt refuses."""
        try:
            prompts = prepare(submit, self._history)
            placeholder = self._admitted(submit)
        except Rejected as e:
            return Refused(submit.rid, e)
        except Exception as e:  # one bad request must not end the thread
            log.exception("admitting %s failed", submit.rid)
            return Refused(submit.rid, Rejected(f"internal error: {type(e).__name__}: {e}",
                                                status=500, code="internal_error"))
        return Loaded(submit.rid, prompts, placeholder)

    def _history(self, submit: Submit, bound: ContextBytes | None = None) -> list[Message]:
        """The messages to render: instructions, the previous response's conversation, the
        request's input. A stored history whose text cannot fit ``bound`` is refused unread."""
        try:
            messages = self.store.conversation(submit, bound)
        except Rejected:
            raise
        except Exception as exc:
            raise self._refusal("read the history of", submit.rid, exc) from None
        conversation = submit.response.conversation if submit.response else None
        if messages is None and conversation is not None:
            raise Rejected(not_found(conversation), status=404, param="conversation",
                           code="not_found")
        if messages is None:
            prev = submit.response.previous_response_id if submit.response else None
            raise Rejected(previous_not_found(str(prev)), status=404,
                           param="previous_response_id", code="previous_response_not_found")
        return check_input(messages)

    def _admitted(self, submit: Submit) -> bool:
        """Writes the placeholder row (none for ``store: false`` unless background); whether
        it did."""
        fields = submit.response
        if fields is None or not (fields.store or fields.background):
            return False
        try:
            self.store.begin(submit)
        except Rejected:  # a conversation that is not there, busy or full
            raise
        except ValueError as e:  # an id already stored, an unknown previous response
            raise Rejected(str(e)) from None
        except Exception as exc:
            raise self._refusal("store", submit.rid, exc) from None
        self._begun.add(submit.rid)
        if fields.background:
            self._queued.add(submit.rid)
        return True

    # --- a session's later life: contained ------------------------------------------------------

    def started(self, rid: str) -> None:
        """The session's first tick: a queued row says in progress."""
        if rid in self._queued:
            self._queued.discard(rid)
            # On failure the row keeps saying queued; the session runs on and ends as usual.
            self._attempt("mark as in progress", rid, self.store.start, rid)

    def ended(self, rid: str, ending: Ending) -> Stored | None:
        """Records how a session ended, if its load wrote a placeholder (a session that ended
        while it loaded may not have one). A completed one is answered: stored, or why not."""
        self._queued.discard(rid)
        if rid not in self._begun:
            return Stored(rid) if isinstance(ending, Completed) else None
        self._begun.discard(rid)
        if isinstance(ending, Completed):
            return self._completed(rid, ending)
        if isinstance(ending, Failed):
            self._fail(rid, ending.message)
        elif not ending.background:  # its client is gone, and nobody will ask for it
            self._attempt_or_fail("remove the placeholder of", rid, self.store.remove,
                                  "the client left; the placeholder could not be removed")
        elif ending.cause is AbortCause.CANCEL:  # the row stays, cancelled
            self._attempt_or_fail("mark as cancelled", rid, self.store.cancel,
                                  "cancelled; the cancellation could not be stored")
        elif ending.cause is AbortCause.SHUTDOWN:  # stopped short: what it had is its result
            self._shutdown(rid, ending)
        else:
            self._fail(rid, f"aborted: {ending.cause.value}")
        return None

    def _completed(self, rid: str, ending: Completed) -> Stored:
        incomplete = "max_output_tokens" if ending.reason is FinishReason.LENGTH else None
        try:
            moved = self.store.complete(rid, ending.output_text, ending.usage,
                                        incomplete_reason=incomplete)
        except Exception as exc:
            self._log("store the result of", rid, exc)
            message = ("the response was generated but could not be stored: "
                       f"{type(exc).__name__}: {exc}")
            self._fail(rid, message)
            return Stored(rid, message)
        return Stored(rid, cancelled=not moved)

    def _shutdown(self, rid: str, ending: Aborted) -> None:
        error = self._attempt("store the partial result of", rid, self.store.complete, rid,
                              ending.output_text, ending.usage or Usage(0, 0),
                              incomplete_reason=SHUTDOWN_REASON)
        if error is not None:
            self._fail(rid, f"aborted: shutdown; its partial result could not be stored: {error}")

    # --- the proxy's side -----------------------------------------------------------------------

    def answer(self, op: ResponseOp) -> ResponseReply:
        """Answers one ResponseOp (ResponseStore.handle_op); a broken store answers 500 rather
        than leave the client waiting."""
        try:
            return self.store.handle_op(op, op.subject in self._begun)
        except Exception as e:
            log.exception("response store failed on %s %s", op.kind, op.subject)
            return ResponseReply(op.op_id, 500, message=f"response store error: {e}")

    # --- plumbing -------------------------------------------------------------------------------

    def _fail(self, rid: str, message: str) -> None:
        self._attempt("mark as failed", rid, self.store.fail, rid, message)

    def _attempt_or_fail(self, what: str, rid: str, call: Callable[[str], None],
                         failed: str) -> None:
        if self._attempt(what, rid, call, rid) is not None:
            self._fail(rid, failed)

    def _attempt(self, what: str, rid: str, call: Callable[..., Any], *args: Any,
                 **kwargs: Any) -> str | None:
        """Runs one store call; None on success, else the error's text (logged)."""
        try:
            call(*args, **kwargs)
        except Exception as exc:
            self._log(what, rid, exc)
            return f"{type(exc).__name__}: {exc}"
        return None

    def _refusal(self, what: str, rid: str, exc: Exception) -> Rejected:
        self._log(what, rid, exc)
        return Rejected(f"the response store failed: {type(exc).__name__}: {exc}", status=500,
                        code="store_error")

    def _log(self, what: str, rid: str, exc: Exception) -> None:
        log.error("response store: could not %s response %s: %s: %s", what, rid,
                  type(exc).__name__, exc)
