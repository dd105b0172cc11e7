"""The proxy's ends of the FIFOs, driven by the asyncio loop; nothing here blocks it.

The proxy reads ``tokens`` and writes ``requests`` and ``control`` (ipc/proxy_writers.py). The
tokens read end stays open across connections; the two write ends open only while a daemon
reads them (ENXIO otherwise) and close with the connection. What was read goes to `on_read`, one
call per read; EOF on tokens and EPIPE on a write go to `on_broken`. What they mean for the
connection is decided on top of this (ipc/connection/proxy.py).

One call may come from another thread: `beat`, the heartbeat, so that the daemon hears from us
however long the loop is busy. It is one write of under PIPE_BUF bytes, atomic beside the
loop's own control writes; the control fd is published to it only once the connection's first
newline is written, and taken back under the same lock before it is closed, so a beat never
lands in half a frame nor on an fd number the system has handed to another file.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from ipc.fifo import CONTROL, REQUESTS, TOKENS, PipeError, grow_pipe, open_reader, try_open_writer
from ipc.framing import proxy_decoder
from ipc.loss import Loss, LossReason
from ipc.proxy_writers import ControlWriter, OutFrame, RequestWriter
from ipc.records import AbortCause
from ipc.wire import ToProxy

log = logging.getLogger("tether.ipc")

READ_CHUNK = 256 * 1024
READS_PER_CALLBACK = 8  # then yield to the loop so HTTP work is not starved by a token flood


class DaemonUnavailable(Exception):
    """The daemon is not connected, or did not take a request in time."""


class ProxyPipes:
    def __init__(self, runtime_dir: Path, on_read: Callable[[list[ToProxy]], None],
                 on_broken: Callable[[Loss], None]) -> None:
        self._paths = {name: Path(runtime_dir) / name for name in (REQUESTS, CONTROL, TOKENS)}
        self._on_read = on_read
        self._on_broken = on_broken
        self._tokens_fd: int | None = None
        self._control_fd: int | None = None
        self._requests_fd: int | None = None
        self._beat_lock = threading.Lock()
        self._beat_fd: int | None = None  # control, for `beat`, from any thread
        self._decoder = proxy_decoder()
        self._read_buffer = memoryview(bytearray(READ_CHUNK))
        self._bad_before = 0  # bad records counted by decoders of earlier connections
        self._control: ControlWriter | None = None
        self._requests: RequestWriter | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._warned: str | None = None

    @property
    def connected(self) -> bool:
        """Both write ends open: a daemon reads them."""
        return self._control_fd is not None

    @property
    def tokens_open(self) -> bool:
        return self._tokens_fd is not None

    @property
    def control_idle(self) -> bool:
        """Connected, and nothing queued on the control pipe."""
        return self._control is not None and self._control.idle

    @property
    def bad_records(self) -> int:
        return self._bad_before + self._decoder.num_bad

    @property
    def aborts_written(self) -> dict[AbortCause, int]:
        """Abort records actually written into the control pipe, by cause."""
        if self._control is None:
            return dict.fromkeys(AbortCause, 0)
        return self._control.aborts_written

    # -- opening and closing ---------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._control = ControlWriter(loop, self._on_broken)
        self._requests = RequestWriter(loop, self._on_broken)
        self.open_tokens()

    def open_tokens(self) -> None:
        assert self._loop is not None
        try:
            fd = open_reader(self._paths[TOKENS])
        except (OSError, PipeError) as exc:
            self._warn_once(f"cannot open {self._paths[TOKENS]}: {exc}")
            return
        grow_pipe(fd)
        self._tokens_fd = fd
        self._bad_before += self._decoder.num_bad
        self._decoder = proxy_decoder()
        self._loop.add_reader(fd, self.read_tokens)

    def _close_tokens(self) -> None:
        if self._tokens_fd is not None and self._loop is not None:
            self._loop.remove_reader(self._tokens_fd)
            os.close(self._tokens_fd)
        self._tokens_fd = None

    def try_connect(self) -> bool:
        """Open both write ends (ENXIO while no daemon reads them); whether they are open."""
        if self._tokens_fd is None:
            return False
        try:
            control = try_open_writer(self._paths[CONTROL])
            if control is None:
                return False
            requests = try_open_writer(self._paths[REQUESTS])
        except (OSError, PipeError) as exc:
            self._warn_once(f"cannot open the daemon's pipes: {exc}")
            return False
        if requests is None:
            os.close(control)
            return False
        grow_pipe(requests)
        self._control_fd, self._requests_fd = control, requests
        assert self._control is not None and self._requests is not None
        # Each first writes a bare newline: the end of any half frame left by an earlier writer.
        self._control.attach(control)
        self._requests.attach(requests)
        with self._beat_lock:
            self._beat_fd = control
        self._warned = None
        return True

    def disconnect(self, why: DaemonUnavailable) -> None:
        """Close the write ends (what is queued fails with `why`) and reopen tokens: a fresh
        read end drops what is left of the old connection, and forgets its hang-up."""
        self._close_writers(why)
        self._close_tokens()
        self.open_tokens()

    def close(self, why: DaemonUnavailable) -> None:
        self._close_writers(why)
        self._close_tokens()

    def _close_writers(self, why: DaemonUnavailable) -> None:
        with self._beat_lock:
            self._beat_fd = None
        if self._control is not None and self._requests is not None:
            self._control.detach()
            self._requests.detach(why)
        for fd in (self._control_fd, self._requests_fd):
            if fd is not None:
                os.close(fd)
        self._control_fd = self._requests_fd = None

    def _warn_once(self, message: str) -> None:
        if message != self._warned:
            log.warning("ipc: %s; retrying", message)
            self._warned = message

    # -- reading tokens --------------------------------------------------------------------

    def read_tokens(self) -> None:
        """Read what is in the tokens pipe now (the loop calls this when it is readable)."""
        fd = self._tokens_fd
        buffer = self._read_buffer
        for _ in range(READS_PER_CALLBACK):
            if fd is None or fd != self._tokens_fd:
                return  # a record handler caused a loss and a reopen
            try:
                # Into one buffer kept for it: os.read would allocate READ_CHUNK bytes each time,
                # which glibc may serve with mmap, mremap and munmap, three system calls a read.
                size = os.readv(fd, (buffer,))
            except BlockingIOError:
                return
            if not size:
                self._on_tokens_eof()
                return
            self._on_read(self._decoder.feed(buffer[:size]))
            if size < READ_CHUNK:
                # The pipe was drained: skip the read that would only say EAGAIN. The reader
                # is level-triggered, so bytes written since wake us again.
                return

    def _on_tokens_eof(self) -> None:
        # Reopen even when nothing is lost: after EOF, poll reports HUP forever on this fd.
        if self.connected:
            self._on_broken(Loss(LossReason.EOF, "daemon closed the tokens pipe (EOF)"))
        else:
            self._close_tokens()
            self.open_tokens()

    # -- writing ---------------------------------------------------------------------------

    def send_control(self, frame: bytes, abort: AbortCause | None = None) -> bool:
        """One control frame, written now or queued in order (ControlWriter.send)."""
        if self._control is None:
            return False
        return self._control.send(frame, abort)

    def beat(self, frame: bytes) -> bool:
        """From any thread: one control frame (<= PIPE_BUF) written now, or dropped (not
        connected, or the pipe full or gone: the loop meets EPIPE or EOF on its own)."""
        with self._beat_lock:
            if self._beat_fd is None:
                return False
            try:
                os.write(self._beat_fd, frame)
            except (BlockingIOError, BrokenPipeError):
                return False
            return True

    def put_request(self, frame: bytes) -> OutFrame:
        """Queue one request frame while connected; it goes out whole, or fails with the
        connection (RequestWriter.detach)."""
        assert self._requests is not None and self.connected
        return self._requests.put(frame)

    def withdraw(self, frame: OutFrame) -> bool:
        """Take back a queued request frame not yet started: then the daemon never sees it."""
        return self._requests is not None and self._requests.withdraw(frame)

    async def wait(self, frame: OutFrame) -> None:
        """Until the frame is wholly in the pipe (RequestWriter.wait)."""
        assert self._requests is not None
        await self._requests.wait(frame)
