"""The daemon's ends of the FIFOs: synchronous, non-blocking, polled once per engine tick.

The daemon reads ``control`` and ``requests`` and is the only writer of ``tokens``. Losing the
proxy is reported once through `DaemonPipes.take_lost`; after a loss, tokens stay closed until
the next Hello, so a proxy that was merely stuck first sees the EOF that tells it to resync
instead of a stream with a silent gap.

A keepalive thread writes an Alive record whenever nothing has gone out for a heartbeat
interval: while a forward pass runs for seconds the proxy still hears from us. It shares the
tokens writer (ipc/tokens_writer.py) with the tick loop under a lock and only ever appends
whole frames, so the pipe keeps one writer's byte order.

The proxy is judged by its reading progress only (nothing taken for MAX_STALL_S), never by how
much waits for it: the tick loop bounds that, adding nothing that can wait while `backlogged`.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ipc.fifo import (
    CONTROL,
    FIFO_NAMES,
    REQUESTS,
    TOKENS,
    PipeError,
    ensure_fifos,
    grow_pipe,
    hung_up,
    open_reader,
)
from ipc.framing import FrameDecoder, daemon_decoder, encode_many
from ipc.loss import Loss, LossReason
from ipc.records import (
    SILENCE_TIMEOUT_S,
    Abort,
    Goodbye,
    Heartbeat,
    Hello,
    Pause,
    Resume,
    Submit,
)
from ipc.response_records import ResponseOp
from ipc.tokens_writer import KEEPALIVE_S, TokensWriter
from ipc.wire import ToDaemon, ToProxy

log = logging.getLogger("tether.ipc")

# Over this the proxy reads more slowly than we write: the tick loop waits for it (the pipe
# itself holds 1 MiB more).
BACKLOG_BOUND_BYTES = 1024 * 1024
# Control frames are small and read every tick: a smaller buffer is cheaper to allocate.
READ_CHUNK = {CONTROL: 64 * 1024, REQUESTS: 1024 * 1024}
# Caps one read_* call so a writer flooding the pipe cannot hold the tick loop forever.
MAX_READS_PER_CALL = 16

_ALLOWED: dict[str, tuple[type, ...]] = {
    CONTROL: (Hello, Heartbeat, Goodbye, Abort, Pause, Resume, ResponseOp),
    REQUESTS: (Submit, ResponseOp),  # a conversation's ops: their items can be big
}


class _Reader:
    """One read end with its decoder. Inherited (systemd) fds are O_RDWR and never see EOF."""

    def __init__(self, name: str, path: Path, inherited_fd: int | None) -> None:
        self.name = name
        self.path = path
        self.inherited = inherited_fd is not None
        self.chunk = READ_CHUNK[name]
        self.fd: int = inherited_fd if inherited_fd is not None else self._open()
        self.decoder: FrameDecoder[ToDaemon] = daemon_decoder(name)

    def _open(self) -> int:
        try:
            fd = open_reader(self.path)
        except OSError as exc:
            raise PipeError(f"{self.path}: cannot open: {exc.strerror}") from None
        grow_pipe(fd)
        return fd

    def read(self) -> tuple[list[ToDaemon], bool]:
        """(records available now, whether every writer has left)."""
        records: list[ToDaemon] = []
        for _ in range(MAX_READS_PER_CALL):
            try:
                data = os.read(self.fd, self.chunk)
            except BlockingIOError:
                return records, False
            if not data:
                return records, hung_up(self.fd)
            records += self._check(self.decoder.feed(data))
        return records, False

    def _check(self, records: list[ToDaemon]) -> list[ToDaemon]:
        allowed = _ALLOWED[self.name]
        if all(isinstance(r, allowed) for r in records):
            return records
        for r in records:
            if not isinstance(r, allowed):
                self.decoder.num_bad += 1
                log.warning("ipc: skipped a %s record on the %s pipe", type(r).__name__, self.name)
        return [r for r in records if isinstance(r, allowed)]

    def reopen(self) -> None:
        """A fresh open forgets the hang-up (poll stops reporting HUP) and any partial frame."""
        if self.inherited:
            return
        os.close(self.fd)
        self.fd = self._open()
        bad = self.decoder.num_bad
        self.decoder = daemon_decoder(self.name)
        self.decoder.num_bad = bad

    def close(self) -> None:
        os.close(self.fd)


class DaemonPipes:
    """The daemon's FIFO ends. Nothing here blocks except `wait_readable`."""

    def __init__(self, runtime_dir: Path, group: str | None = None,
                 inherited: dict[str, int] | None = None, *,
                 heartbeat_timeout: float | None = SILENCE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        inherited = dict(inherited or {})
        for fd in inherited.values():
            os.set_blocking(fd, False)
        paths = {name: Path(runtime_dir) / name for name in FIFO_NAMES}
        if any(name not in inherited for name in FIFO_NAMES):
            paths = ensure_fifos(Path(runtime_dir), group)
        self._control = _Reader(CONTROL, paths[CONTROL], inherited.get(CONTROL))
        self._requests = _Reader(REQUESTS, paths[REQUESTS], inherited.get(REQUESTS))
        self._tokens = TokensWriter(paths[TOKENS], inherited.get(TOKENS))
        self.heartbeat_timeout = heartbeat_timeout
        self.clock = clock  # the silence and flush bounds are measured on it
        self._last_control: float | None = None
        self._lost: Loss | None = None
        # A systemd-held tokens pipe never tells us whether a proxy reads it: wait for a Hello.
        self._await_hello = TOKENS in inherited
        self._proxy_seen = False
        self._said_goodbye = False  # the proxy's EOF after its Goodbye is a close, not a loss
        self._held_control: list[ToDaemon] = []  # read ahead at a requests EOF (read_requests)
        self.num_dropped = 0  # records sent while no proxy was there
        self._closing = threading.Event()
        self._keepalive = threading.Thread(target=self._keep_alive, name="tether-keepalive",
                                           daemon=True)
        self._keepalive.start()

    def _keep_alive(self) -> None:
        while not self._closing.wait(KEEPALIVE_S / 2):
            self._tokens.keepalive(self.clock())

    # -- reading ---------------------------------------------------------------------------

    def read_control(self) -> list[ToDaemon]:
        # The clock is read before the pipe: a process stopped (SIGSTOP, a long page fault)
        # between an empty read and a later look at the clock would take the records the proxy
        # wrote meanwhile, unread in the pipe, for silence.
        now = self.clock()
        records, eof = self._read(self._control)
        if self._held_control:
            records, self._held_control = self._held_control + records, []
        if records:
            self._last_control = now
            if any(isinstance(r, Hello) for r in records):
                self._await_hello = False
                self._proxy_seen = True
                self._tokens.next_try = 0.0  # a proxy is there now: the Welcome must not wait
            self._note_goodbye(records)
        elif (self.heartbeat_timeout is not None and self._last_control is not None
              and now - self._last_control > self.heartbeat_timeout):
            self._lose(Loss(LossReason.SILENCE,
                            f"no heartbeat from the proxy for {self.heartbeat_timeout:g} s"))
        if eof:
            self._lose(Loss(LossReason.EOF, "proxy closed the control pipe (EOF)"), reopen=True)
        return records

    def _note_goodbye(self, records: list[ToDaemon]) -> None:
        """Note whether the last Hello or Goodbye among `records` was a Goodbye."""
        for r in records:
            if isinstance(r, Hello | Goodbye):
                self._said_goodbye = isinstance(r, Goodbye)

    def read_requests(self) -> list[ToDaemon]:
        records, eof = self._read(self._requests)
        if eof:
            if not self._said_goodbye:
                # A stopping proxy writes its Goodbye on control, then closes both pipes: one
                # written after this tick's control read is still there, and makes the EOF a
                # close. What was read is handed to the next read_control.
                held, _ = self._read(self._control)
                self._held_control += held
                self._note_goodbye(held)
            self._lose(Loss(LossReason.EOF, "proxy closed the requests pipe (EOF)"), reopen=True)
        return records

    def _read(self, reader: _Reader) -> tuple[list[ToDaemon], bool]:
        try:
            return reader.read()
        except OSError as exc:
            raise PipeError(f"{reader.path}: read failed: {exc.strerror}") from None

    def wait_readable(self, timeout: float) -> None:
        """Sleep until control or requests has data (or a hang-up), or ``timeout`` passes.

        Meanwhile keeps flushing the tokens backlog as the proxy drains it, and returns once a
        backlog over the bound is back under it.
        """
        deadline = self.clock() + timeout
        already_lost = self._lost is not None
        backlogged = self.backlogged
        while True:
            now = self.clock()
            if self._open_tokens(now):
                self._flush(now)
            remaining = deadline - now
            if remaining <= 0 or (self._lost is not None and not already_lost):
                return  # a loss found while flushing is news for the caller's take_lost()
            if backlogged and not self.backlogged:
                return  # the tick loop may go on
            poller = select.poll()
            poller.register(self._control.fd, select.POLLIN)
            poller.register(self._requests.fd, select.POLLIN)
            tokens_fd = self._tokens.fd if self._tokens.buf else None
            if tokens_fd is not None:
                poller.register(tokens_fd, select.POLLOUT)
            # Round up: a 0 ms poll for a sub-millisecond remainder would spin.
            events = poller.poll(int(remaining * 1000) + 1)
            if not events or any(fd != tokens_fd for fd, _ in events):
                return

    # -- writing ---------------------------------------------------------------------------

    def send(self, records: list[ToProxy]) -> None:
        """Queue records for the proxy and write what the pipe takes; dropped if no proxy."""
        now = self.clock()
        if not self._open_tokens(now):
            self.num_dropped += len(records)
            return
        loss = self._tokens.send(encode_many(records), now) if records else \
            self._tokens.flush(now)
        if loss is not None:
            self._lose(loss)

    def _open_tokens(self, now: float) -> bool:
        if self._await_hello:
            return False
        if self._tokens.fd is None and self._tokens.try_open(now):
            self._proxy_seen = True
        return self._tokens.fd is not None

    def _flush(self, now: float) -> None:
        loss = self._tokens.flush(now)
        if loss is not None:
            self._lose(loss)

    # -- liveness --------------------------------------------------------------------------

    def _lose(self, loss: Loss, reopen: bool = False) -> None:
        if reopen:
            # Both: the other pipe is about to hang up too, and its unread Submits are stale.
            self._control.reopen()
            self._requests.reopen()
        self._tokens.drop()
        self._last_control = None
        self._await_hello = True
        if self._said_goodbye and loss.reason is LossReason.EOF:
            log.info("ipc: the proxy closed its pipes after its goodbye")
        elif self._proxy_seen and self._lost is None:
            log.warning("ipc: proxy lost: %s", loss.detail)
            self._lost = loss
        self._proxy_seen = self._said_goodbye = False

    def take_lost(self) -> Loss | None:
        """Why the proxy was lost since the last call, or None."""
        loss, self._lost = self._lost, None
        return loss

    @property
    def bad_records(self) -> dict[str, int]:
        return {CONTROL: self._control.decoder.num_bad, REQUESTS: self._requests.decoder.num_bad}

    @property
    def proxy_connected(self) -> bool:
        return self._tokens.fd is not None and not self._await_hello

    @property
    def tokens_backlog(self) -> int:
        return len(self._tokens.buf)

    @property
    def backlogged(self) -> bool:
        """The proxy reads more slowly than we write: add nothing that can wait. (Under the
        writer's lock: between a send's append and its write the buffer only looks long.)"""
        with self._tokens.lock:
            return len(self._tokens.buf) > BACKLOG_BOUND_BYTES

    def stop_keepalive(self) -> None:
        """Nothing more from the keepalive thread: a Goodbye stays the last record written."""
        self._closing.set()
        self._keepalive.join()

    def close(self) -> None:
        self.stop_keepalive()
        self._control.close()
        self._requests.close()
        self._tokens.close()
