"""The three FIFOs between proxy and daemon, and the connection over them: the public API.

``requests`` and ``control`` carry proxy -> daemon records, ``tokens`` daemon -> proxy ones.
Each side has its pipes, which move records and notice a peer that died or hung (a `Loss`, with
its `LossReason`), and a connection on top of them: Hello -> Welcome, the epoch the daemon
assigns to each connection, Goodbye. The daemon side (`DaemonPipes`, `DaemonConnection`) is
synchronous and polled from the tick loop; the proxy side (`ProxyPipes`, `ProxyConnection`)
lives on the asyncio loop. Implementation: ipc/fifo.py, ipc/daemon_side.py, ipc/proxy_side.py,
ipc/connection/.
"""

from ipc.connection.daemon import (
    Connected,
    ControlItem,
    DaemonConnection,
    Lost,
    ModelInfo,
    Stale,
)
from ipc.connection.epochs import EpochCounter
from ipc.connection.proxy import ProxyConnection
from ipc.daemon_side import DaemonPipes
from ipc.fifo import CONTROL, FIFO_NAMES, REQUESTS, TOKENS, PipeError, ensure_fifos
from ipc.loss import Loss, LossReason
from ipc.proxy_side import DaemonUnavailable, ProxyPipes
from ipc.systemd_fds import inherited_fifos

__all__ = [
    "CONTROL",
    "FIFO_NAMES",
    "REQUESTS",
    "TOKENS",
    "Connected",
    "ControlItem",
    "DaemonConnection",
    "DaemonPipes",
    "DaemonUnavailable",
    "EpochCounter",
    "Loss",
    "LossReason",
    "Lost",
    "ModelInfo",
    "PipeError",
    "ProxyConnection",
    "ProxyPipes",
    "Stale",
    "ensure_fifos",
    "inherited_fifos",
]
