"""File descriptors passed by systemd socket activation (sd_listen_fds(3), without libsystemd).

A socket unit with ``ListenFIFO=`` + ``FileDescriptorName=`` hands the service its FIFOs as fds
3, 4, ... and names them in ``LISTEN_FDNAMES``. systemd keeps them open O_RDWR, so the daemon
never sees EOF or EPIPE on them: liveness then rests on heartbeats and the tokens backlog bound.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SD_LISTEN_FDS_START = 3


def inherited_fifos(environ: Mapping[str, str] | None = None) -> dict[str, int] | None:
    """{name: fd} of the fds systemd passed to this process, or None if none were meant for us.

    None when LISTEN_PID is missing or names another process (the variables leaked from a
    parent), or LISTEN_FDS is missing or 0. Unnamed fds get systemd's default name "unknown"
    (the last of equal names wins). Raises ValueError on malformed variables.
    """
    env = os.environ if environ is None else environ
    pid_text = env.get("LISTEN_PID")
    count_text = env.get("LISTEN_FDS")
    if not pid_text or not count_text:
        return None
    pid = _parse_int("LISTEN_PID", pid_text)
    if pid != os.getpid():
        return None
    count = _parse_int("LISTEN_FDS", count_text)
    if count < 0:
        raise ValueError(f"LISTEN_FDS must be >= 0, got {count}")
    if count == 0:
        return None
    names_text = env.get("LISTEN_FDNAMES")
    names = names_text.split(":") if names_text else ["unknown"] * count
    if len(names) != count:
        raise ValueError(f"LISTEN_FDNAMES has {len(names)} names but LISTEN_FDS is {count}")
    fds = {name: SD_LISTEN_FDS_START + i for i, name in enumerate(names)}
    for fd in fds.values():
        # Like sd_listen_fds(): the fds are ours, not for processes we start.
        try:
            os.set_inheritable(fd, False)
        except OSError:
            raise ValueError(f"LISTEN_FDS passes fd {fd}, but it is not open") from None
    return fds


def _parse_int(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None
