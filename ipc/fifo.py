"""The three FIFOs on disk: creation, permission checks and non-blocking opens.

Both sides open every FIFO with O_NONBLOCK: a blocking open() of a FIFO waits for the other end
and would freeze the daemon's tick loop or the proxy's event loop.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import logging
import os
import select
import stat
from pathlib import Path

log = logging.getLogger("tether.ipc")

REQUESTS = "requests"
CONTROL = "control"
TOKENS = "tokens"
FIFO_NAMES = (REQUESTS, CONTROL, TOKENS)

# Bigger than the 64 KiB default so a burst of tokens or a long prompt fits in one go.
PIPE_SIZE = 1024 * 1024
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class PipeError(Exception):
    """A FIFO or its directory is unusable; the message names the path and the problem."""


def resolve_group(group: str | int | None) -> int | None:
    """A group name or numeric gid -> gid; None stays None."""
    if group is None:
        return None
    if isinstance(group, int) or group.isdigit():
        gid = int(group)
        try:
            grp.getgrgid(gid)
        except KeyError:
            raise PipeError(f"pipe group {group!r}: no such gid") from None
        return gid
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise PipeError(f"pipe group {group!r}: no such group") from None


def ensure_fifos(runtime_dir: Path, group: str | int | None = None) -> dict[str, Path]:
    """Create (or check) the runtime dir and the three FIFOs; return {name: path}.

    Owner-only (dir 0700, FIFOs 0600) unless ``group`` is given (0750 / 0660, chgrp'd to it).
    Our own paths with a wrong mode or group are fixed; a path that is not a FIFO (or not a
    directory) or that another user owns is refused, since it could be a planted trap.
    """
    gid = ensure_dir(runtime_dir, group)
    runtime_dir = Path(runtime_dir)
    paths = {name: runtime_dir / name for name in FIFO_NAMES}
    for path in paths.values():
        _ensure_node(path, 0o660 if gid is not None else 0o600, gid, is_dir=False)
    return paths


def ensure_dir(runtime_dir: Path, group: str | int | None = None) -> int | None:
    """Create (or check) the runtime dir alone, as `ensure_fifos` does; returns the group's gid."""
    gid = resolve_group(group)
    _ensure_node(Path(runtime_dir), 0o750 if gid is not None else 0o700, gid, is_dir=True)
    return gid


def _ensure_node(path: Path, mode: int, gid: int | None, *, is_dir: bool) -> None:
    try:
        if is_dir:
            path.mkdir(mode=mode, parents=True)
        else:
            os.mkfifo(path, mode)
    except FileExistsError:
        pass
    except OSError as exc:
        raise PipeError(f"{path}: cannot create: {exc.strerror}") from None
    st = os.lstat(path)
    wanted_type, kind = (stat.S_ISDIR, "directory") if is_dir else (stat.S_ISFIFO, "FIFO")
    if not wanted_type(st.st_mode):
        raise PipeError(f"{path}: exists but is a {_describe(st.st_mode)}, not a {kind}; "
                        "remove it or choose another --runtime-dir")
    if st.st_uid != os.geteuid():
        raise PipeError(f"{path}: owned by uid {st.st_uid}, not by this user "
                        f"(uid {os.geteuid()}); refusing to use it")
    if gid is not None and st.st_gid != gid:
        os.chown(path, -1, gid)
    if stat.S_IMODE(st.st_mode) != mode:
        # The umask may have narrowed the mode at creation; an old dir may be too open.
        os.chmod(path, mode)


def _describe(mode: int) -> str:
    kinds = ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"),
             (stat.S_ISLNK, "symlink"), (stat.S_ISSOCK, "socket"), (stat.S_ISFIFO, "FIFO"),
             (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))
    return next((name for test, name in kinds if test(mode)), "special file")


def open_fifo(path: Path, flags: int) -> int:
    """Open a FIFO non-blockingly; OSError (ENXIO: no reader, ENOENT) passes through.

    PipeError if the path is not a FIFO (e.g. replaced behind our back).
    """
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        os.close(fd)
        raise PipeError(f"{path}: not a FIFO")
    return fd


def open_reader(path: Path) -> int:
    return open_fifo(path, os.O_RDONLY)


def try_open_writer(path: Path) -> int | None:
    """The write end, or None while nobody reads (ENXIO) or the FIFO does not exist yet."""
    try:
        return open_fifo(path, os.O_WRONLY)
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.ENOENT):
            return None
        raise


def grow_pipe(fd: int, size: int = PIPE_SIZE) -> None:
    """Best effort: the unprivileged ceiling is /proc/sys/fs/pipe-max-size."""
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, size)
    except OSError as exc:
        log.debug("ipc: could not grow pipe buffer to %d bytes: %s", size, exc)


def hung_up(fd: int) -> bool:
    """True if every writer of this read end has gone away since it was opened.

    A FIFO read end opened with O_NONBLOCK reads b"" both before any writer came and after the
    last one left; only the latter raises POLLHUP, which is how the two are told apart.
    """
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return any(ev & select.POLLHUP for _, ev in poller.poll(0))
