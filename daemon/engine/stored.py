"""The engine's side of the responses room (daemon/responses/lifecycle.py): Responses turns
whose history is loading, and completed ones whose last Finish waits for their result to be
stored.

A turn that needs the store is admitted (its client hears Admitted, and its session is one of
the engine's) but its session has no sequences until the store thread has rendered its prompt
with its history and written its placeholder, so one whose client leaves meanwhile is never
prefilled: its eviction drops it here at once, and the load's answer, when it comes, finds
nobody (the store thread removes what the load wrote, as the end it was told after the load). A
completed stored turn's last Finish is held until the store thread says its result is stored, or
why it is not: what a client hears as completed is in the store. A load the store has not
answered within LOAD_TIMEOUT_S (a store that hangs rather than fails) is that request's 503, and
whatever it wrote is removed after it.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.engine.figures import Figures
from daemon.engine.sequence import Session
from daemon.rejected import Rejected
from daemon.responses.lifecycle import (
    Completed,
    Loaded,
    Prepare,
    Refused,
    Responses,
    Stored,
)
from ipc.records import AbortCause, Finish, FinishReason, Submit, Usage
from ipc.wire import ToProxy

LOAD_TIMEOUT_S = 60.0


@dataclass(slots=True)
class Loading:
    submit: Submit
    session: Session  # its sequences come with its prompts
    deadline: float


@dataclass(slots=True)
class Ready:
    """A loaded turn, for the engine to build and schedule."""

    loading: Loading
    prompts: list[list[int]]
    placeholder: bool


class StoredTurns:
    def __init__(self, responses: Responses, figures: Figures) -> None:
        self.responses = responses
        self.figures = figures
        self.loading: dict[str, Loading] = {}
        self._storing: dict[str, tuple[Session, Finish]] = {}

    @property
    def waiting(self) -> bool:
        """Turns wait for the store: loading, or their result being stored."""
        return bool(self.loading or self._storing)

    @property
    def num_storing(self) -> int:
        return len(self._storing)

    def load(self, submit: Submit, session: Session, prepare: Prepare) -> None:
        deadline = self.figures.clock() + LOAD_TIMEOUT_S
        self.loading[submit.rid] = Loading(submit, session, deadline)
        self.responses.load(submit, prepare)

    def drop(self, rid: str) -> Loading | None:
        """The turn ended while it loaded: its load's answer is dropped when it comes."""
        return self.loading.pop(rid, None)

    def store(self, session: Session, finish: Finish) -> None:
        """Its model work is done: its result goes to the store, and ``finish`` (its last) to
        its client once the store has it."""
        session.placeholder = False
        self._storing[session.rid] = session, finish
        self.responses.ended(session.rid, Completed(finish.reason, session.output_text(),
                                                    session.usage))

    def take(self) -> tuple[list[Ready], list[tuple[Session, Rejected]], list[ToProxy]]:
        """What came back: the loaded turns still wanted, the ones refused (by their load, or
        by the time it took), and the stored turns' last Finishes."""
        ready: list[Ready] = []
        refused: list[tuple[Session, Rejected]] = []
        out: list[ToProxy] = []
        for result in self.responses.take_results():
            if isinstance(result, Stored):
                out += self._stored(result)
            elif (loading := self.loading.pop(result.rid, None)) is None:
                continue  # it ended while it loaded
            elif isinstance(result, Loaded):
                ready.append(Ready(loading, result.prompts, result.placeholder))
            elif isinstance(result, Refused):
                refused.append((loading.session, result.rejected))
        return ready, refused + self._expired(), out

    def _expired(self) -> list[tuple[Session, Rejected]]:
        """The loads a store that hangs has not answered within LOAD_TIMEOUT_S."""
        if not self.loading:
            return []
        now = self.figures.clock()
        return [(self.loading.pop(rid).session, Rejected(
                    f"the response store did not answer within {LOAD_TIMEOUT_S:g} s; nothing "
                    "was stored", status=503, code="store_timeout"))
                for rid in [rid for rid, turn in self.loading.items() if now >= turn.deadline]]

    def _stored(self, result: Stored) -> list[ToProxy]:
        held = self._storing.pop(result.rid, None)
        if held is None:
            return []
        session, finish = held
        if result.cancelled:  # cancelled while its last tokens came: it stays cancelled
            self.figures.evicted(session, FinishReason.ABORT, AbortCause.CANCEL, None)
            return [Finish(finish.rid, finish.index, FinishReason.ABORT, finish.usage,
                           cause=AbortCause.CANCEL)]
        if result.error is not None:  # the client learns that its response was not stored
            self.figures.completed(session, FinishReason.ERROR, result.error)
            return [Finish(finish.rid, finish.index, FinishReason.ERROR, finish.usage,
                           message=result.error)]
        self.figures.completed(session, finish.reason, None)
        return [finish]

    def close(self, timeout: float) -> list[ToProxy]:
        """The daemon stops: the store thread finishes what it was told within ``timeout``;
        the Finishes it stored go out, and any it did not answer say so."""
        self.responses.close(timeout)
        _, _, out = self.take()
        for rid in list(self._storing):
            out += self._stored(Stored(rid, "the server stopped before the response was stored"))
        return out


def unbuilt_finishes(submit: Submit, reason: FinishReason, cause: AbortCause | None,
                     message: str | None) -> list[Finish]:
    """The Finishes of a request that ended before its sequences were built: one for each it
    asked for."""
    return [Finish(submit.rid, i, reason, Usage(0, 0), cause=cause, message=message)
            for i in range(submit.num_sequences)]
