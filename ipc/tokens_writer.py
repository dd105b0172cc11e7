"""The daemon's tokens write end: the pipe's only writer, with a buffer the proxy drains.

The tick loop and the keepalive thread share it under a lock and each appends whole frames
only, so the pipe keeps one writer's byte order. The proxy is judged by its reading progress
(nothing taken for MAX_STALL_S), never by how much waits for it.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import msgspec

from ipc.fifo import grow_pipe, try_open_writer
from ipc.loss import Loss, LossReason
from ipc.records import HEARTBEAT_INTERVAL_S, Alive

# A backlog the proxy has not taken a byte of for this long means it stopped reading. Judged by
# progress, not by how long the buffer has been non-empty: under a steady flood it never empties.
MAX_STALL_S = 2.0
TOKENS_RETRY_S = 0.05
KEEPALIVE_S = HEARTBEAT_INTERVAL_S


class TokensWriter:
    """The tokens write end with its buffer. The daemon is the pipe's only writer, so a partial
    write is simply continued later; the tick loop and the keepalive thread share it under
    `lock`, and each appends whole frames only."""

    def __init__(self, path: Path, inherited_fd: int | None) -> None:
        self.path = path
        self.inherited_fd = inherited_fd
        self.lock = threading.Lock()
        self.fd: int | None = None
        self.buf = bytearray()
        self.last_write = 0.0  # when bytes last went into the pipe
        self.stuck_since = 0.0  # the later of: buf went non-empty, the pipe last took bytes
        self.broken: Loss | None = None  # EPIPE met by the keepalive thread, for the loop
        self.next_try = 0.0

    def try_open(self, now: float) -> bool:
        with self.lock:
            if self.fd is not None:
                return True
            if self.inherited_fd is not None:
                self.fd = self.inherited_fd
            elif now < self.next_try:
                return False
            else:
                self.next_try = now + TOKENS_RETRY_S
                self.fd = try_open_writer(self.path)
                if self.fd is None:
                    return False
                grow_pipe(self.fd)
            # A new connection starts with a newline: it ends any half frame left in the pipe.
            self._append(b"\n", now)
            self.last_write = now  # no Alive before the Welcome
            return True

    def _append(self, data: bytes, now: float) -> None:
        if not self.buf:
            self.stuck_since = now
        self.buf += data

    def send(self, data: bytes, now: float) -> Loss | None:
        with self.lock:
            self._append(data, now)
            return self._flush(now)

    def flush(self, now: float) -> Loss | None:
        """Write what the pipe takes now; why the proxy is lost, if it is."""
        with self.lock:
            return self._flush(now)

    def _flush(self, now: float) -> Loss | None:
        if self.broken is not None:
            return self.broken
        buf = self.buf
        moved = False
        while buf and self.fd is not None:
            try:
                n = os.write(self.fd, buf)
            except BlockingIOError:
                break
            except BrokenPipeError:
                return Loss(LossReason.EPIPE, "proxy closed the tokens pipe (EPIPE)")
            del buf[:n]
            moved = True
        if moved:
            self.last_write = self.stuck_since = now
        if not buf:
            return None
        if now - self.stuck_since > MAX_STALL_S:
            return Loss(LossReason.STALLED_READER,
                        f"the proxy took nothing from the tokens pipe for {MAX_STALL_S:g} s")
        return None

    def keepalive(self, now: float) -> None:
        """From the keepalive thread: an Alive record if nothing went out for a while."""
        with self.lock:
            if self.fd is None or self.broken is not None or now - self.last_write < KEEPALIVE_S:
                return
            self._append(msgspec.json.encode(Alive(now)) + b"\n", now)
            loss = self._flush(now)
            if loss is not None and loss.reason is LossReason.EPIPE:
                self.broken = loss

    def drop(self) -> None:
        """Forget the buffer and let go of the proxy (an inherited fd is kept, only idled)."""
        with self.lock:
            self.buf.clear()
            self.broken = None
            if self.fd is not None and self.fd != self.inherited_fd:
                os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self.drop()
        if self.inherited_fd is not None:
            os.close(self.inherited_fd)
            self.inherited_fd = None
