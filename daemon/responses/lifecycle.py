"""A stored response's life, the one room the engine and the server go through for the store.

The engine calls it at a few named points of a Responses session: `history` to render the
prompt, `admitted` when the session opens (the placeholder row), `started` at its first tick and
`ended` however it ends (`Completed`, `Failed`, `Aborted`). The server has it answer ResponseOps
and hand over the cancels that reached another replica. A background response that the daemon's
shutdown stops is stored as what it is, incomplete, with the text and usage it had.

A failing store costs one session, never the daemon. A store can fail at any call (a full disk,
a read-only database, a lost connection to a database server). The engine's records never wait on
that: an admission the store cannot serve is that request's error; a session that ends while the
store cannot record the end still gets its Finish records (its response then says failed, with
the reason), and the store is asked to mark the row ``failed`` so that a later GET agrees. Every
failure is logged as an error naming the response; no other session, and not the tick loop, ever
sees the exception.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from daemon.rejected import ContextBytes, Rejected
from daemon.responses.conversations import not_found
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
                 incomplete_reason: str | None = None) -> None: ...
    def remove(self, rid: str) -> None: ...
    def cancel(self, rid: str) -> None: ...
    def fail(self, rid: str, message: str) -> None: ...
    def num_placeholders(self) -> int: ...
    def conversation_counts(self) -> tuple[int, int]: ...
    def handle_op(self, op: ResponseOp, running: bool) -> ResponseReply: ...
    def take_cancels(self) -> list[str]: ...


# --- how a session ends ---------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Completed:
    """The model ended it: ``reason`` STOP (completed) or LENGTH (incomplete)."""

    reason: FinishReason
    output_text: str
    usage: Usage


@dataclass(slots=True, frozen=True)
class Failed:
    message: str


@dataclass(slots=True, frozen=True)
class Aborted:
    cause: AbortCause
    background: bool  # a background response outlives its client; a foreground one goes with it
    output_text: str = ""  # what it had generated
    usage: Usage | None = None


Ending = Completed | Failed | Aborted


class Responses:
    """The engine's and the server's side of the store; used from the tick thread only."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._queued: set[str] = set()  # background rows that say queued until a first tick

    # --- admission: a failure is that request's error ------------------------------------------

    def history(self, submit: Submit, bound: ContextBytes | None = None) -> list[Message]:
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
        if not any(m.role != "system" for m in messages):
            raise Rejected("input must not be empty", param="input")
        return messages

    def admitted(self, submit: Submit) -> bool:
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

    def ended(self, rid: str, ending: Ending) -> str | None:
        """Records the end of a session that has a placeholder. None, or why its result could
        not be stored, for the session's Finish (the row is then failed if it still can be)."""
        self._queued.discard(rid)
        if isinstance(ending, Completed):
            incomplete = "max_output_tokens" if ending.reason is FinishReason.LENGTH else None
            error = self._attempt("store the result of", rid, self.store.complete, rid,
                                  ending.output_text, ending.usage, incomplete_reason=incomplete)
            if error is None:
                return None
            message = f"the response was generated but could not be stored: {error}"
            self._fail(rid, message)
            return message
        if isinstance(ending, Failed):
            self._fail(rid, ending.message)
        elif not ending.background:  # its client is gone, and nobody will ask for it
            self._attempt_or_fail("remove the placeholder of", rid, self.store.remove,
                                  "the client left; the placeholder could not be removed")
        elif ending.cause is AbortCause.CANCEL:  # the row stays, cancelled
            self._attempt_or_fail("mark as cancelled", rid, self.store.cancel,
                                  "cancelled; the cancellation could not be stored")
        elif ending.cause is AbortCause.SHUTDOWN:  # stopped short: what it had is its result
            error = self._attempt("store the partial result of", rid, self.store.complete, rid,
                                  ending.output_text, ending.usage or Usage(0, 0),
                                  incomplete_reason=SHUTDOWN_REASON)
            if error is not None:
                self._fail(rid, f"aborted: shutdown; its partial result could not be stored: "
                           f"{error}")
        else:
            self._fail(rid, f"aborted: {ending.cause.value}")
        return None

    def num_placeholders(self) -> int:
        return self.store.num_placeholders()

    def conversation_counts(self) -> tuple[int, int]:
        return self.store.conversation_counts()

    # --- the server's side ----------------------------------------------------------------------

    def handle_op(self, op: ResponseOp, running: bool) -> ResponseReply:
        """Answers one ResponseOp (ResponseStore.handle_op); a broken store answers 500 rather
        than leave the client waiting."""
        try:
            return self.store.handle_op(op, running)
        except Exception as e:
            log.exception("response store failed on %s %s", op.kind, op.subject)
            return ResponseReply(op.op_id, 500, message=f"response store error: {e}")

    def take_cancels(self) -> list[str]:
        """Responses of ours cancelled through another replica (no I/O: the watcher fetched
        them)."""
        return self.store.take_cancels()

    # --- plumbing -------------------------------------------------------------------------------

    def _fail(self, rid: str, message: str) -> None:
        self._attempt("mark as failed", rid, self.store.fail, rid, message)

    def _attempt_or_fail(self, what: str, rid: str, call: Callable[[str], None],
                         failed: str) -> None:
        if self._attempt(what, rid, call, rid) is not None:
            self._fail(rid, failed)

    def _attempt(self, what: str, rid: str, call: Callable[..., None], *args: Any,
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
