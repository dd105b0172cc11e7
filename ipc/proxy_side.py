"""The proxy's ends of the FIFOs, driven by the asyncio loop; nothing here blocks it.

The proxy reads ``tokens`` and writes ``requests`` and ``control`` (ipc/proxy_writers.py). The
daemon is "up" once the write ends are open and its Welcome for this connection has arrived,
which assigns the connection's epoch; it is lost on EOF on tokens, EPIPE on a write,
SILENCE_TIMEOUT_S (3 s) of silence (it sends Stats or Alive at least every 250 ms) or a protocol
version mismatch (its Welcome or its Error record says so).
After a loss everything is reopened and the connection retried every 100 ms.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

from ipc.fifo import CONTROL, REQUESTS, TOKENS, PipeError, grow_pipe, open_reader, try_open_writer
from ipc.framing import encode, encode_control, proxy_decoder
from ipc.proxy_writers import ControlWriter, OutFrame, RequestWriter
from ipc.records import (
    HEARTBEAT_INTERVAL_S,
    PROTOCOL_VERSION,
    SILENCE_TIMEOUT_S,
    Abort,
    AbortCause,
    Error,
    Goodbye,
    Heartbeat,
    Hello,
    Pause,
    ResponseOp,
    Resume,
    Submit,
    ToProxy,
    Welcome,
    version_mismatch,
)

log = logging.getLogger("tether.ipc")

RETRY_S = 0.1
VERSION_RETRY_S = 5.0  # a mismatched daemon will not change its mind in 100 ms
HEARTBEAT_S = HEARTBEAT_INTERVAL_S
HELLO_REPEAT_S = 1.0
SILENCE_S = SILENCE_TIMEOUT_S
TICK_S = 0.05
CLOCK_SLACK_S = 0.002
READ_CHUNK = 256 * 1024
READS_PER_CALLBACK = 8  # then yield to the loop so HTTP work is not starved by a token flood


class DaemonUnavailable(Exception):
    """The daemon is not connected, or did not take a request in time."""


class ProxyPipes:
    def __init__(self, runtime_dir: Path, on_record: Callable[[ToProxy], None],
                 on_state: Callable[[bool, str], None],
                 on_delivered: Callable[[], None] | None = None) -> None:
        self.epoch = 0  # the current connection's, assigned by the daemon's Welcome
        self.up = False
        self._paths = {name: Path(runtime_dir) / name for name in (REQUESTS, CONTROL, TOKENS)}
        self._on_record = on_record
        self._on_state = on_state
        # After each read's records were all handed to on_record: a consumer that routes them
        # to many readers wakes each once per read, not once per record.
        self._on_delivered = on_delivered
        self._tokens_fd: int | None = None
        self._control_fd: int | None = None
        self._requests_fd: int | None = None
        self._decoder = proxy_decoder()
        self._read_buffer = memoryview(bytearray(READ_CHUNK))
        self._bad_before = 0  # bad records counted by decoders of earlier connections
        self._last_record = 0.0
        self._next_heartbeat = 0.0
        self._next_hello = 0.0
        self._retry_at = 0.0
        self._nonce = 0  # this connection's, echoed by its Welcome
        self._control: ControlWriter | None = None
        self._requests: RequestWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._nudge: asyncio.Future[None] | None = None  # wakes the supervisor early
        self._loop: asyncio.AbstractEventLoop | None = None
        self._warned: str | None = None
        self._mismatch_logged: str | None = None

    @property
    def connected(self) -> bool:
        """Write ends open (the daemon may not have welcomed us yet)."""
        return self._control_fd is not None

    @property
    def bad_records(self) -> int:
        return self._bad_before + self._decoder.num_bad

    @property
    def aborts_written(self) -> dict[AbortCause, int]:
        """Abort records actually written into the control pipe, by cause."""
        if self._control is None:
            return dict.fromkeys(AbortCause, 0)
        return self._control.aborts_written

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._control = ControlWriter(loop, self._lose)
        self._requests = RequestWriter(loop, self._lose)
        self._open_tokens()
        self._try_connect()
        self._task = asyncio.create_task(self._supervise(), name="tether-ipc-supervisor")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self.up and self._control is not None and self._control.idle:
            try:
                self._control.send(encode_control(Goodbye(self.epoch)))
            except OSError:
                pass  # the daemon is gone or busy: it will see EOF either way
        self.up = False
        self._close_writers(DaemonUnavailable("proxy is shutting down"))
        self._close_tokens()

    async def _supervise(self) -> None:
        assert self._loop is not None
        loop = self._loop
        delay = TICK_S
        while True:
            # A timer, or _lose, wakes us: while up nothing is due for up to a heartbeat
            # interval, so the loop is not woken 20 times a second for nothing.
            nudge = self._nudge = loop.create_future()
            timer = loop.call_later(delay, _wake, nudge)
            try:
                await nudge
            finally:
                timer.cancel()
                self._nudge = None
            try:
                delay = self._check(time.monotonic())
            except Exception:
                # Reconnecting must outlive any surprise, or the proxy stays 503 for good.
                log.exception("ipc: supervisor step failed")
                delay = TICK_S

    def _check(self, now: float) -> float:
        """Reconnect, greet, heartbeat and watch for silence; returns when to look again."""
        if self._tokens_fd is None:
            self._open_tokens()
        if not self.connected:
            if now >= self._retry_at:
                self._retry_at = now + RETRY_S
                self._try_connect()
            return TICK_S
        if not self.up and now >= self._next_hello:
            self._say_hello(now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + HEARTBEAT_S
            self._send_control(encode_control(Heartbeat(self.epoch, now)), droppable=True)
            if not self.connected:
                return TICK_S  # the heartbeat found the daemon gone
        if self.up and now - self._last_record > SILENCE_S:
            # Look in the pipe first: stopped between this wake-up and the loop's next poll,
            # we would take the records waiting there for silence.
            self._on_tokens_readable()
            if self.up and now - self._last_record > SILENCE_S:
                self._lose(f"no record from the daemon for {SILENCE_S:g} s")
        if not self.up:
            return TICK_S
        # Records only move the silence deadline later, so waking at the earlier of the two
        # deadlines misses nothing (the slack covers a loop clock of millisecond resolution).
        due = min(self._next_heartbeat, self._last_record + SILENCE_S)
        return max(due - now, 0.0) + CLOCK_SLACK_S

    # -- opening ---------------------------------------------------------------------------

    def _open_tokens(self) -> None:
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
        self._loop.add_reader(fd, self._on_tokens_readable)

    def _close_tokens(self) -> None:
        if self._tokens_fd is not None and self._loop is not None:
            self._loop.remove_reader(self._tokens_fd)
            os.close(self._tokens_fd)
        self._tokens_fd = None

    def _try_connect(self) -> None:
        """Open both write ends (ENXIO while no daemon reads them), then say Hello."""
        if self._tokens_fd is None:
            return
        try:
            control = try_open_writer(self._paths[CONTROL])
            if control is None:
                return
            requests = try_open_writer(self._paths[REQUESTS])
        except (OSError, PipeError) as exc:
            self._warn_once(f"cannot open the daemon's pipes: {exc}")
            return
        if requests is None:
            os.close(control)
            return
        grow_pipe(requests)
        self._control_fd, self._requests_fd = control, requests
        assert self._control is not None and self._requests is not None
        # Each first writes a bare newline: the end of any half frame left by an earlier writer.
        self._control.attach(control)
        self._requests.attach(requests)
        self._warned = None
        self._nonce = random.getrandbits(62) + 1
        log.info("ipc: pipes open, waiting for the daemon's Welcome")
        now = time.monotonic()
        self._say_hello(now)
        self._next_heartbeat = now + HEARTBEAT_S

    def _say_hello(self, now: float) -> None:
        # Repeated until welcomed: a daemon that was not ready to answer may have dropped it.
        self._next_hello = now + HELLO_REPEAT_S
        hello = Hello(version=PROTOCOL_VERSION, pid=os.getpid(), epoch=self.epoch + 1,
                      nonce=self._nonce)
        self._send_control(encode_control(hello))

    def _warn_once(self, message: str) -> None:
        if message != self._warned:
            log.warning("ipc: %s; retrying", message)
            self._warned = message

    # -- reading tokens --------------------------------------------------------------------

    def _on_tokens_readable(self) -> None:
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
            self._last_record = time.monotonic()
            records = self._decoder.feed(buffer[:size])
            if self.up:
                self._deliver(records)
            else:
                for record in records:
                    self._dispatch(record)
            if size < READ_CHUNK:
                # The pipe was drained: skip the read that would only say EAGAIN. The reader
                # is level-triggered, so bytes written since wake us again.
                return

    def _on_tokens_eof(self) -> None:
        # Reopen even when nothing is lost: after EOF, poll reports HUP forever on this fd.
        if self.connected:
            self._lose("daemon closed the tokens pipe (EOF)")
        else:
            self._close_tokens()
            self._open_tokens()

    def _dispatch(self, record: ToProxy) -> None:
        if self.up:
            self._deliver([record])
        elif self.connected and isinstance(record, Welcome):
            self._welcome(record)
        elif self.connected and isinstance(record, Error) and record.rid is None:
            self._refused(record)
        # Anything else before this connection's Welcome is left over from an earlier one.

    def _deliver(self, records: list[ToProxy]) -> None:
        # The hot path (hundreds of thousands of records/s): no per-record checks but one.
        on_record = self._on_record
        try:
            for record in records:
                try:
                    on_record(record)
                except Exception:
                    log.exception("ipc: on_record failed for a %s record", type(record).__name__)
                if not self.up:
                    return  # a handler caused a loss: the rest belongs to the old connection
        finally:
            if self._on_delivered is not None:
                try:
                    self._on_delivered()
                except Exception:
                    log.exception("ipc: on_delivered failed")

    def _welcome(self, welcome: Welcome) -> None:
        if welcome.version != PROTOCOL_VERSION:
            self._mismatch(version_mismatch(welcome.version, PROTOCOL_VERSION))
            return
        if welcome.nonce != self._nonce:
            log.warning("ipc: ignoring a Welcome meant for another connection")
            return
        self.epoch = welcome.epoch
        self.up = True
        self._last_record = time.monotonic()
        log.info("ipc: daemon pid %d up (model %s), epoch %d", welcome.pid, welcome.model,
                 welcome.epoch)
        self._on_state(True, "connected")
        self._dispatch(welcome)

    def _refused(self, error: Error) -> None:
        """A daemon-wide Error before the Welcome: it refused our Hello (another protocol
        version, as its message says); anything else is only logged."""
        if error.code == "version_mismatch" or "version" in error.message:
            self._mismatch(error.message)
        else:
            log.error("ipc: daemon error: %s", error.message)

    def _mismatch(self, message: str) -> None:
        if message != self._mismatch_logged:  # retried every few seconds: said once
            log.error("ipc: %s", message)
            self._mismatch_logged = message
        self._lose(message, retry_in=VERSION_RETRY_S, notify=True)

    # -- writing ---------------------------------------------------------------------------

    def control(self, record: Abort | Pause | Resume | ResponseOp | Goodbye) -> bool:
        """Send a control record with one atomic write (queued in order if the pipe is full).

        False if the daemon is down or the queue is full (the record is then dropped).
        """
        if not self.up:
            return False
        cause = record.cause if isinstance(record, Abort) else None
        return self._send_control(encode_control(record), abort=cause)

    def _send_control(self, frame: bytes, droppable: bool = False,
                      abort: AbortCause | None = None) -> bool:
        if self._control is None:
            return False
        return self._control.send(frame, abort, droppable)

    def queue_submit(self, record: Submit) -> OutFrame:
        """Queue one Submit frame on the current connection; it goes out whole, whatever becomes
        of the caller. DaemonUnavailable if the daemon is down or the record was made for an
        earlier connection (its epoch would be refused, or worse, taken for a newer one)."""
        if not self.up or self._requests is None:
            raise DaemonUnavailable("the engine daemon is not connected")
        if record.epoch != self.epoch:
            raise DaemonUnavailable("the connection to the engine daemon was renewed")
        return self._requests.put(encode(record))

    def withdraw(self, frame: OutFrame) -> bool:
        """Take back a queued Submit not yet started: then the daemon never sees it."""
        return self._requests is not None and self._requests.withdraw(frame)

    # The timeout parameter is the agreed API (ASYNC109 prefers asyncio.timeout at the caller).
    async def submit(self, record: Submit, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        """Write one Submit frame and wait until it is wholly in the pipe; DaemonUnavailable if
        the daemon is down or nothing of it went out within ``timeout`` seconds."""
        frame = self.queue_submit(record)
        assert self._requests is not None
        try:
            async with asyncio.timeout(timeout):
                await self._requests.wait(frame)
        except TimeoutError:
            if self.withdraw(frame):
                raise DaemonUnavailable(
                    f"requests pipe full: the daemon took nothing for {timeout:g} s") from None
            await self._requests.wait(frame)  # started: it is finished whatever happens

    # -- losing the daemon -----------------------------------------------------------------

    def _lose(self, reason: str, retry_in: float = RETRY_S, notify: bool = False) -> None:
        """Drop the connection and start retrying; on_state hears of it if we were up."""
        if not self.connected:
            return
        was_up, self.up = self.up, False
        log.warning("ipc: daemon lost: %s", reason)
        self._close_writers(DaemonUnavailable(f"the engine daemon went away: {reason}"))
        self._close_tokens()
        self._open_tokens()
        self._retry_at = time.monotonic() + retry_in
        if self._nudge is not None:
            _wake(self._nudge)  # back to ticking at once, to reconnect on time
        if was_up or notify:
            self._on_state(False, reason)

    def _close_writers(self, why: DaemonUnavailable) -> None:
        if self._control is not None and self._requests is not None:
            self._control.detach()
            self._requests.detach(why)
        for fd in (self._control_fd, self._requests_fd):
            if fd is not None:
                os.close(fd)
        self._control_fd = self._requests_fd = None


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
