"""A stored response's life, the one room the engine and the server go through for the store.

The engine calls it at a few named points of a Responses session, and none of them waits on the
store: its work runs on the room's own thread (store_thread.py, with keeper.py: the store's side
of each call, where a failing store costs one session, never the daemon), and the tick reads
what it did (`take_results`) between two forward passes.

- `load`: a turn that needs the store (a stored history to read, or a placeholder row to write)
  is a pending admission stage, as a grammar's compile is: its client hears Admitted at once,
  and the thread renders its prompt with its history and writes its placeholder, then hands the
  engine its prompts (`Loaded`) or its refusal (`Refused`). A turn that needs neither is
  rendered on the tick as any chat is (`history`).
- `started` at a session's first tick (a queued background row says in progress), `ended`
  however it ends (`Completed`, `Failed`, `Aborted`): events, in order after the load, so a
  session that ended while it loaded leaves nothing stored. A completed one is answered
  (`Stored`), and the engine holds its last Finish until then: a client hears `completed` only
  once its response is in the store.

The server has it answer ResponseOps (`put_op`, `take_reply`) and hand over the cancels that
reached another replica. A background response that the daemon's shutdown stops is stored as
what it is, incomplete, with the text and usage it had.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from daemon.rejected import ContextBytes
from daemon.responses.events import (
    Aborted,
    Completed,
    Ending,
    Failed,
    History,
    Loaded,
    Prepare,
    Refused,
    Result,
    Stored,
)
from daemon.responses.keeper import Keeper, Store, check_input
from daemon.responses.store_thread import StoreThread
from ipc.records import Message, Submit
from ipc.response_records import ResponseOp, ResponseReply

__all__ = ["Aborted", "Completed", "Ending", "Failed", "History", "Loaded", "Prepare", "Refused",
           "Responses", "Result", "Store", "Stored"]


class Responses:
    """The engine's and the server's side of the store; used from the tick thread only."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self._thread = StoreThread(Keeper(store), clock)

    # --- admission ------------------------------------------------------------------------------

    @staticmethod
    def needs_store(submit: Submit) -> bool:
        """Whether a Responses turn reads a stored history or writes a placeholder row."""
        fields = submit.response
        return fields is not None and (fields.store or fields.background
                                       or fields.previous_response_id is not None
                                       or fields.conversation is not None)

    @staticmethod
    def history(submit: Submit, bound: ContextBytes | None = None) -> list[Message]:
        """The messages of a turn that needs no store: its instructions and its input."""
        fields = submit.response
        assert fields is not None and not Responses.needs_store(submit)
        head = [Message("system", fields.instructions)] if fields.instructions else []
        return check_input(head + fields.input)

    def load(self, submit: Submit, prepare: Prepare) -> None:
        """Starts a pending turn's load: `Loaded` or `Refused` comes back."""
        self._thread.do(lambda keeper: keeper.load(submit, prepare))

    # --- a session's later life -----------------------------------------------------------------

    def started(self, rid: str) -> None:
        """The session's first tick."""
        self._thread.do(lambda keeper: keeper.started(rid))

    def ended(self, rid: str, ending: Ending) -> None:
        """A session that may hold a placeholder ended; a `Completed` one is answered
        (`Stored`)."""
        self._thread.do(lambda keeper: keeper.ended(rid, ending))

    def take_results(self) -> list[Result]:
        """What the thread has done for the engine since the last call, in order."""
        return self._thread.take_results()

    @property
    def busy(self) -> bool:
        """The thread has work in hand, or answers the tick has not taken."""
        return self._thread.busy

    def conversation_counts(self) -> tuple[int, int]:
        return self.store.conversation_counts()

    # --- the server's side ----------------------------------------------------------------------

    def put_op(self, op: ResponseOp) -> ResponseReply | None:
        """Queues a ResponseOp; or, past the queue's bounds, the 503 that answers it now."""
        return self._thread.put_op(op)

    def clear_ops(self) -> None:
        self._thread.clear_ops()

    def take_reply(self) -> tuple[ResponseOp, ResponseReply] | None:
        """The next answered op, in the order they were answered."""
        return self._thread.take_reply()

    @property
    def has_reply(self) -> bool:
        return self._thread.has_reply

    def take_cancels(self) -> list[str]:
        """Responses of ours cancelled through another replica (no I/O: the watcher fetched
        them)."""
        return self.store.take_cancels()

    def close(self, timeout: float) -> bool:
        """The daemon stops: the thread finishes what it was told (the ends of the sessions)
        within ``timeout``, and stops; whether it did."""
        return self._thread.close(timeout)
