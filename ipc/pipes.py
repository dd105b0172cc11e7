"""The three FIFOs between proxy and daemon: the public API.

``requests`` and ``control`` carry proxy -> daemon records, ``tokens`` daemon -> proxy ones.
The daemon side (`DaemonPipes`) is synchronous and polled from the tick loop; the proxy side
(`ProxyPipes`) lives on the asyncio loop. Implementation: ipc/fifo.py, ipc/daemon_side.py,
ipc/proxy_side.py.
"""

from ipc.daemon_side import DaemonPipes
from ipc.fifo import CONTROL, FIFO_NAMES, REQUESTS, TOKENS, PipeError, ensure_fifos
from ipc.proxy_side import DaemonUnavailable, ProxyPipes
from ipc.systemd_fds import inherited_fifos

__all__ = [
    "CONTROL",
    "FIFO_NAMES",
    "REQUESTS",
    "TOKENS",
    "DaemonPipes",
    "DaemonUnavailable",
    "PipeError",
    "ProxyPipes",
    "ensure_fifos",
    "inherited_fifos",
]
