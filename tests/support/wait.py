"""Free ports and polling with a deadline (blocking, and for async tests)."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

# Below Linux's ephemeral range (32768-60999): a port handed out for some client's outgoing
# connection can never collide with a block chosen here.
_BLOCK_RANGE = (20000, 32000)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_block(count: int) -> int:
    """The first of `count` consecutive ports that are free now (for a command that takes a
    base port and uses the ones after it, like `tether cluster`)."""
    for _ in range(200):
        base = random.randrange(_BLOCK_RANGE[0], _BLOCK_RANGE[1] - count)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no block of {count} free ports in {_BLOCK_RANGE}")


def at_once(count: int, call: Callable[[int], Any], timeout: float = 300.0) -> list[Any]:
    """`call(i)` for each i below `count`, each in its own thread, released together; their
    results."""
    results: list[Any] = [None] * count
    start = threading.Barrier(count)

    def run(i: int) -> None:
        start.wait()
        results[i] = call(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return results


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


async def wait_until(cond: Callable[[], object], timeout: float = 5.0) -> None:  # noqa: ASYNC109
    """`wait_for` on the event loop: polls without blocking it."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s"
        await asyncio.sleep(0.01)
