"""The epochs the daemon assigns to proxy connections.

A Submit is admitted only under the current epoch, so an epoch must never be handed out twice
while records written under it may still sit in a FIFO's buffer. Those buffers can outlive
either process (a systemd-held FIFO outlives both), so the highest epoch is kept in a file next
to the FIFOs: it counts on across restarts, and the wall clock, which can step back, plays no
part. Without the file (no runtime directory of our own, or it is read-only) the count lives in
memory, and the proxy's proposal (its own last epoch + 1) still keeps each proxy's epochs rising.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

log = logging.getLogger("tether.ipc")


class EpochCounter:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.highest = self._load()

    def _load(self) -> int:
        if self.path is None:
            return 0
        try:
            return max(int(self.path.read_text().strip() or 0), 0)
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as exc:
            log.warning("epoch file %s unreadable (%s); counting from 0", self.path, exc)
            return 0

    def next(self, at_least: int = 0) -> int:
        """A new epoch above every one handed out before, and at least `at_least`."""
        self.highest = max(self.highest + 1, at_least)
        self._save()
        return self.highest

    def _save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(f"{self.highest}\n")
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("cannot keep the epoch in %s (%s); counting in memory", self.path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()
            self.path = None
