"""The response store as the engine uses it: a failing store costs one session, never the daemon.

A store can fail at any call (a full disk, a read-only database, a lost connection to a database
server). The engine's records never wait on that: an admission the store cannot serve is that
request's error; a session that ends while the store cannot record the end still gets its Finish
records (its response then says failed, with the reason), and the store is asked to mark the row
``failed`` so that a later GET agrees. Every failure is logged as an error naming the response;
no other session, and not the tick loop, ever sees the exception.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from daemon.engine.admission import Rejected
from ipc.records import Submit, Usage

log = logging.getLogger("tether.store")


class Store(Protocol):
    def conversation(self, submit: Submit) -> Any: ...
    def begin(self, submit: Submit) -> None: ...
    def start(self, rid: str) -> None: ...
    def complete(self, rid: str, output_text: str, usage: Usage, *,
                 incomplete_reason: str | None = None) -> None: ...
    def remove(self, rid: str) -> None: ...
    def cancel(self, rid: str) -> None: ...
    def fail(self, rid: str, message: str) -> None: ...
    def num_placeholders(self) -> int: ...


class GuardedStore:
    def __init__(self, store: Store) -> None:
        self.store = store

    # --- admission: a failure is that request's error ------------------------------------------

    def conversation(self, submit: Submit) -> Any:
        try:
            return self.store.conversation(submit)
        except ValueError:  # the client's input: the caller answers 400
            raise
        except Exception as exc:
            raise self._refusal("read the history of", submit.rid, exc) from None

    def begin(self, submit: Submit) -> None:
        try:
            self.store.begin(submit)
        except ValueError:  # an id already stored, an unknown previous response
            raise
        except Exception as exc:
            raise self._refusal("store", submit.rid, exc) from None

    # --- a session's later life: contained ------------------------------------------------------

    def start(self, rid: str) -> None:
        # The row keeps saying queued; the session runs on and its end is recorded as usual.
        self._attempt("mark as in progress", rid, self.store.start, rid)

    def complete(self, rid: str, output_text: str, usage: Usage, *,
                 incomplete_reason: str | None = None) -> str | None:
        """None when recorded; else why not, for the session's Finish (the row is then failed
        if the store can still record that)."""
        error = self._attempt("store the result of", rid, self.store.complete, rid, output_text,
                              usage, incomplete_reason=incomplete_reason)
        if error is None:
            return None
        message = f"the response was generated but could not be stored: {error}"
        self.fail(rid, message)
        return message

    def remove(self, rid: str) -> None:
        if self._attempt("remove the placeholder of", rid, self.store.remove, rid) is not None:
            self.fail(rid, "the client left; the placeholder could not be removed")

    def cancel(self, rid: str) -> None:
        if self._attempt("mark as cancelled", rid, self.store.cancel, rid) is not None:
            self.fail(rid, "cancelled; the cancellation could not be stored")

    def fail(self, rid: str, message: str) -> None:
        self._attempt("mark as failed", rid, self.store.fail, rid, message)

    def num_placeholders(self) -> int:
        return self.store.num_placeholders()

    # --- plumbing -------------------------------------------------------------------------------

    def _attempt(self, what: str, rid: str, call: Any, *args: Any, **kwargs: Any) -> str | None:
        """Runs one store call; None on success, else the error's text (logged and counted)."""
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
