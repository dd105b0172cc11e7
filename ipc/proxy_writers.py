"""The proxy's two write ends, driven by loop callbacks rather than by the tasks that queue frames.

A frame written in pieces must be finished once started, or the daemon's decoder is left with
half a frame; so no caller's cancellation may cut a write. Callers queue frames here and may wait
for them; the writing itself belongs to the pipe. Each new connection starts with a bare newline
on the pipe, which ends any half frame an earlier connection left there.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from collections.abc import Callable

from ipc.loss import Loss, LossReason
from ipc.records import AbortCause

log = logging.getLogger("tether.ipc")

SEPARATOR = b"\n"
MAX_CONTROL_QUEUE = 4096

OnBroken = Callable[[Loss], None]
REQUESTS_EPIPE = Loss(LossReason.EPIPE, "daemon closed the requests pipe (EPIPE)")
CONTROL_EPIPE = Loss(LossReason.EPIPE, "daemon closed the control pipe (EPIPE)")


class OutFrame:
    """One queued request frame; `started` once its first byte is in the pipe."""

    __slots__ = ("data", "done", "waiter")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.done = 0
        self.waiter: asyncio.Future[None] | None = None

    @property
    def started(self) -> bool:
        return self.done > 0

    def _settle(self, exc: BaseException | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            if exc is None:
                self.waiter.set_result(None)
            else:
                self.waiter.set_exception(exc)
                self.waiter.exception()  # its waiter may be gone: not an unretrieved error


class RequestWriter:
    """The requests pipe: frames go out whole and in order, written as the daemon makes room."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_broken: OnBroken) -> None:
        self._loop = loop
        self._on_broken = on_broken
        self._queue: collections.deque[OutFrame] = collections.deque()
        self._fd: int | None = None
        self._watching = False

    def attach(self, fd: int) -> None:
        self._fd = fd
        self._queue.appendleft(OutFrame(SEPARATOR))
        self._flush()

    def detach(self, why: BaseException) -> None:
        """The connection is gone: every queued frame fails (none may go out on the next one)."""
        self._unwatch()
        self._fd = None
        queue, self._queue = self._queue, collections.deque()
        for frame in queue:
            frame._settle(why)

    def put(self, data: bytes) -> OutFrame:
        frame = OutFrame(data)
        self._queue.append(frame)
        if len(self._queue) == 1:
            self._flush()
        return frame

    def withdraw(self, frame: OutFrame) -> bool:
        """Takes back a frame not yet started; False once any of it is in the pipe."""
        if frame.started:
            return False
        try:
            self._queue.remove(frame)
        except ValueError:
            return False
        return True

    async def wait(self, frame: OutFrame) -> None:
        """Until the frame is wholly in the pipe. Cancelling this wait cancels nothing else."""
        if frame.done == len(frame.data):
            return
        if frame.waiter is None:
            frame.waiter = self._loop.create_future()
        await asyncio.shield(frame.waiter)

    def _flush(self) -> None:
        fd = self._fd
        queue = self._queue
        while queue and fd is not None:
            frame = queue[0]
            try:
                frame.done += os.write(fd, memoryview(frame.data)[frame.done:])
            except BlockingIOError:
                self._watch()
                return
            except BrokenPipeError:
                self._on_broken(REQUESTS_EPIPE)
                return
            if frame.done == len(frame.data):
                queue.popleft()
                frame._settle(None)
        self._unwatch()

    def _watch(self) -> None:
        if not self._watching and self._fd is not None:
            self._loop.add_writer(self._fd, self._flush)
            self._watching = True

    def _unwatch(self) -> None:
        if self._watching and self._fd is not None:
            self._loop.remove_writer(self._fd)
        self._watching = False


class ControlWriter:
    """The control pipe: each frame fits PIPE_BUF and goes out with one atomic write; frames that
    meet a full pipe queue in order. Counts the Aborts actually written, by cause."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_broken: OnBroken) -> None:
        self._loop = loop
        self._on_broken = on_broken
        self._queue: collections.deque[tuple[bytes, AbortCause | None]] = collections.deque()
        self._fd: int | None = None
        self.aborts_written: dict[AbortCause, int] = dict.fromkeys(AbortCause, 0)

    def attach(self, fd: int) -> None:
        self._fd = fd
        self.send(SEPARATOR)

    def detach(self) -> None:
        if self._fd is not None and self._queue:
            self._loop.remove_writer(self._fd)
        self._queue.clear()
        self._fd = None

    @property
    def idle(self) -> bool:
        return self._fd is not None and not self._queue

    def send(self, frame: bytes, abort: AbortCause | None = None) -> bool:
        """Writes now or queues; False if not connected, or dropped (the queue is full)."""
        fd = self._fd
        if fd is None:
            return False
        if not self._queue:
            try:
                os.write(fd, frame)  # <= PIPE_BUF: all or EAGAIN, never a part
            except BlockingIOError:
                self._loop.add_writer(fd, self._flush)
            except BrokenPipeError:
                self._on_broken(CONTROL_EPIPE)
                return False
            else:
                self._count(abort)
                return True
        if len(self._queue) >= MAX_CONTROL_QUEUE:
            log.warning("ipc: control queue full (%d records); dropping one", MAX_CONTROL_QUEUE)
            return False
        self._queue.append((frame, abort))
        return True

    def _count(self, abort: AbortCause | None) -> None:
        if abort is not None:
            self.aborts_written[abort] += 1

    def _flush(self) -> None:
        fd = self._fd
        queue = self._queue
        while queue and fd is not None:
            frame, abort = queue[0]
            try:
                os.write(fd, frame)
            except BlockingIOError:
                return
            except BrokenPipeError:
                self._on_broken(CONTROL_EPIPE)
                return
            queue.popleft()
            self._count(abort)
        if fd is not None:
            self._loop.remove_writer(fd)
