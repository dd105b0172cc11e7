"""The sd_notify protocol, both ends, without libsystemd.

A service tells its supervisor how it is doing by sending one datagram of ``KEY=VALUE`` lines
(``READY=1``, ``WATCHDOG=1``, ``STATUS=...``, ``STOPPING=1``) to the AF_UNIX socket named in
``$NOTIFY_SOCKET``; a leading ``@`` names a socket in the abstract namespace. The supervisor is
systemd under the unit files, or `tether serve` (tether/launcher.py) on a terminal, which binds a
`NotifyListener` and so behaves like systemd towards its two children.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tether.sdnotify")

Notify = Callable[[str], bool]

# struct ucred: pid_t pid, uid_t uid, gid_t gid
_UCRED = struct.Struct("iII")
_MAX_DATAGRAM = 4096


def socket_address(name: str) -> str | bytes:
    """The address to bind or connect for a NOTIFY_SOCKET value ('@' = abstract namespace)."""
    if name.startswith("@"):
        return b"\0" + name[1:].encode()
    return name


class _Drops:
    """Notifications dropped because the supervisor's queue was full; warned about at most once
    per `WARN_EVERY_S`, so a stuck supervisor cannot flood the log either."""

    WARN_EVERY_S = 10.0

    def __init__(self) -> None:
        self.count = 0
        self.warned_at: float | None = None

    def add(self, name: str, message: str) -> None:
        self.count += 1
        now = time.monotonic()
        if self.warned_at is None or now - self.warned_at >= self.WARN_EVERY_S:
            self.warned_at = now
            first = message.partition("\n")[0]
            log.warning("sd_notify to %s: the supervisor's queue is full; dropped %r "
                        "(%d dropped so far)", name, first, self.count)


dropped = _Drops()


class _Channel:
    """The one socket a process notifies through, opened on first use and kept: a process out
    of descriptors (EMFILE) must still reach its watchdog. Opened again when a send fails (the
    supervisor's socket was bound anew) or NOTIFY_SOCKET names another socket."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # notify() may be called from any thread
        self._sock: socket.socket | None = None
        self._name = ""

    def send(self, name: str, data: bytes) -> None:
        with self._lock:
            if self._sock is not None and self._name == name:
                try:
                    self._sock.send(data)
                    return
                except BlockingIOError:
                    raise  # the supervisor's queue is full: the socket is fine
                except OSError:
                    pass
            self._open(name)
            assert self._sock is not None
            self._sock.send(data)

    def _open(self, name: str) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        sock = socket.socket(socket.AF_UNIX,
                             socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            sock.connect(socket_address(name))
        except OSError:
            sock.close()
            raise
        self._sock, self._name = sock, name


_channel = _Channel()


def notify(message: str) -> bool:
    """Send one notification; False when there is no supervisor to tell, it cannot be reached,
    or its queue is full. Never blocks: the daemon's tick loop and the proxy's event loop call it,
    and a supervisor that reads slowly must not stall them."""
    name = os.environ.get("NOTIFY_SOCKET", "")
    if not name.startswith(("/", "@")):
        # Unset, or a vsock address (systemd in a VM): nothing this module speaks.
        return False
    try:
        _channel.send(name, message.encode())
    except BlockingIOError:
        dropped.add(name, message)
        return False
    except OSError as exc:
        # A lost READY=1 makes systemd time the unit out, which is visible; crashing is worse.
        log.warning("sd_notify to %s failed: %s", name, exc)
        return False
    return True


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half the supervisor's period), or None if not asked."""
    env = os.environ if environ is None else environ
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid and pid.strip() != str(os.getpid()):
        # Inherited from a parent that is the one being watched, not us.
        return None
    return usec / 2_000_000


@dataclass(frozen=True, slots=True)
class Notification:
    pid: int | None  # sender, from SCM_CREDENTIALS (None if the kernel sent none)
    fields: dict[str, str]


def parse(datagram: bytes) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in datagram.decode(errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if sep and key:
            fields[key] = value
    return fields


class NotifyListener:
    """The supervisor's end: a datagram socket that children find through NOTIFY_SOCKET.

    SO_PASSCRED makes the kernel attach each sender's pid, so notifications can be matched to
    the child that sent them (systemd's NotifyAccess=main does the same).
    """

    def __init__(self, path: Path | None = None) -> None:
        self.sock = socket.socket(
            socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
        )
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._path = path
        if path is None:
            self.name = f"@tether-notify-{os.getpid()}-{secrets.token_hex(6)}"
        else:
            path.unlink(missing_ok=True)
            self.name = str(path)
        self.sock.bind(socket_address(self.name))

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self) -> list[Notification]:
        """Every notification queued now; never blocks."""
        out: list[Notification] = []
        while True:
            try:
                data, ancdata, _, _ = self.sock.recvmsg(
                    _MAX_DATAGRAM, socket.CMSG_SPACE(_UCRED.size)
                )
            except (BlockingIOError, InterruptedError):
                return out
            pid = None
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = _UCRED.unpack_from(payload)[0]
            out.append(Notification(pid, parse(data)))

    def close(self) -> None:
        self.sock.close()
        if self._path is not None:
            self._path.unlink(missing_ok=True)
