"""Who owns a runtime directory: one daemon and one proxy, each holding its role's lock file.

Two pairs on one directory share its FIFOs: the second proxy attaches to the first pair's
daemon and the two proxies take the connection from each other, silently. So each process of a
pair holds an exclusive flock(2) on its role's file there (``daemon.lock``, ``proxy.lock``) for
its whole life, and a second daemon or a second proxy is refused at start. One file per role,
not one for the pair: the daemon and the proxy are separate processes (two systemd units, or two
children of `tether serve`) that must both hold the directory at once. The kernel drops a flock
when its holder dies, however it dies, so a file left by a dead pair is taken over silently (and
a child restarted after its predecessor died takes it back); the pid written in the file only
names the holder in the refusal.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import os
from pathlib import Path

from ipc.fifo import PipeError, ensure_dir


class Role(enum.StrEnum):
    DAEMON = "daemon"
    PROXY = "proxy"


class RuntimeDirInUse(PipeError):
    """Another live process holds this role's lock: the message names the directory, the
    holder's pid and the way out."""

    def __init__(self, runtime_dir: Path, role: Role, pid: int | None) -> None:
        holder = f"pid {pid}" if pid is not None else "pid unknown"
        super().__init__(f"runtime directory {runtime_dir} is in use by another tether {role} "
                         f"({holder}); stop that pair, or give this one its own --runtime-dir")
        self.pid = pid


class DirLock:
    """One role's lock, held until `release` or the process's death."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the flock goes with the last descriptor of the open file
            self._fd = None


def lock_path(runtime_dir: Path, role: Role) -> Path:
    return Path(runtime_dir) / f"{role}.lock"


def take(runtime_dir: Path, role: Role, group: str | int | None = None) -> DirLock:
    """Hold `role`'s lock on `runtime_dir` (created as the FIFOs' directory is) and write our
    pid into it. RuntimeDirInUse if a live process holds it; PipeError if it cannot be locked."""
    ensure_dir(runtime_dir, group)
    fd = _lock(runtime_dir, role)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return DirLock(fd)


def check_free(runtime_dir: Path, group: str | int | None = None) -> None:
    """Raise RuntimeDirInUse if any role's lock is held: `tether serve` asks before it starts
    its children, so a second pair stops before either of them touches the FIFOs."""
    ensure_dir(runtime_dir, group)
    for role in Role:
        os.close(_lock(runtime_dir, role))


def _lock(runtime_dir: Path, role: Role) -> int:
    path = lock_path(runtime_dir, role)
    try:
        # O_NOFOLLOW: a symlink planted here must not make us truncate its target.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise PipeError(f"{path}: cannot open the lock file: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        pid = _holder(fd)
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise RuntimeDirInUse(Path(runtime_dir), role, pid) from None
        # ENOLCK: a network file system without a lock manager. Refused rather than run
        # unguarded; the FIFOs want a local directory anyway (/run, /tmp).
        raise PipeError(f"{path}: cannot lock: {exc.strerror}; use a local --runtime-dir") \
            from None
    return fd


def _holder(fd: int) -> int | None:
    """The pid the holder wrote, or None (still being written, or not a pid)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
