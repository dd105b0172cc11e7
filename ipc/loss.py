"""Why one side took the other for gone: a reason to act on, and the words for the log.

Both sides' pipes and connections report a lost peer as a `Loss`; code branches on its
`reason`, people read its `detail` (the proxy's 503s and /health quote it)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class LossReason(enum.StrEnum):
    EOF = "eof"  # the peer closed its end of a pipe: it exited or crashed
    EPIPE = "epipe"  # a write found nobody reading
    SILENCE = "silence"  # nothing heard within the silence bound: hung alive
    STALLED_READER = "stalled_reader"  # the proxy took nothing from a full tokens pipe
    VERSION_MISMATCH = "version_mismatch"  # the peer speaks another protocol version
    STOPPED = "stopped"  # the peer said Goodbye: a clean stop, not a failure


@dataclass(frozen=True, slots=True)
class Loss:
    reason: LossReason
    detail: str
