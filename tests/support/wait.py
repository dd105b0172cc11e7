"""Free ports and polling with a deadline."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(cond: Callable[[], object], timeout: float, what: str | Callable[[], str]) -> None:
    """Polls `cond` until it is true; AssertionError naming `what` after `timeout` seconds.

    `what` may be a callable, called only on a timeout: a message quoting a log must be read
    then, not when the wait begins.
    """
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            text = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {text}")
        time.sleep(0.02)
