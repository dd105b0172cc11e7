"""What the tick and the store thread tell each other about a stored response's session.

The engine tells the responses room how a session ends (an `Ending`); the store thread answers a
pending turn's load (`Loaded` or `Refused`) and a completed turn's storing (`Stored`), which the
tick reads between two forward passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from daemon.rejected import ContextBytes, Rejected
from ipc.records import AbortCause, FinishReason, Message, Submit, Usage

# A turn's messages, as the store gives them (its instructions, history and input).
History = Callable[[Submit, ContextBytes], list[Message]]
# The engine's admission of a turn once its history is at hand: its prompts' token ids, or
# Rejected. It runs on the store thread, so a long history is rendered off the tick.
Prepare = Callable[[Submit, History], list[list[int]]]


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


# --- what the store thread answers ----------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Loaded:
    """A pending turn is ready: its prompts, and whether its placeholder row was written."""

    rid: str
    prompts: list[list[int]]
    placeholder: bool


@dataclass(slots=True, frozen=True)
class Refused:
    """A pending turn its load refused (404 previous response, 409 conversation busy, a store
    error, a prompt past the context): nothing of it was stored."""

    rid: str
    rejected: Rejected


@dataclass(slots=True, frozen=True)
class Stored:
    """A completed turn's result is in the store (``error`` None), or could not be stored
    (``error``: why, the row failed if it still could be), or found its row ended already
    (``cancelled``: cancelled or deleted meanwhile, so nothing was stored)."""

    rid: str
    error: str | None = None
    cancelled: bool = False


Result = Loaded | Refused | Stored
