"""Real faults for the fault tests: a process stopped and continued with signals, a FIFO looked
into, squeezed or filled from outside. Nothing here pretends; each acts on the real thing."""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import signal
import subprocess
import termios
from collections.abc import Iterator
from pathlib import Path

_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


@contextlib.contextmanager
def stopped(proc: subprocess.Popen[bytes] | None) -> Iterator[None]:
    """SIGSTOP for the block, SIGCONT after: the process hangs alive, as a stuck one would."""
    assert proc is not None and proc.poll() is None
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def fifo_pending(path: Path) -> int:
    """Bytes written into the FIFO and not yet read (FIONREAD on a read end of our own)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        count = array.array("i", [0])
        fcntl.ioctl(fd, termios.FIONREAD, count)
        return int(count[0])
    finally:
        os.close(fd)


def shrink_and_fill(path: Path, size: int = 4096) -> int:
    """Shrinks the FIFO's buffer to `size` bytes and fills it with empty lines (which a frame
    reader skips); returns the write end, which the caller closes. The FIFO must be empty and
    its reader stopped, or the reader drains it at once."""
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    fcntl.fcntl(fd, _F_SETPIPE_SZ, size)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(fd, b"\n" * 512)
    return fd
