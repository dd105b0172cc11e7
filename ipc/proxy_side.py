"""The proxy's ends of the FIFOs, driven by the asyncio loop; nothing here blocks it.

The proxy reads ``tokens`` and writes ``requests`` and ``control``. The daemon is "up" once the
write ends are open and its Welcome has arrived; it is lost on EOF on tokens, EPIPE on a write,
SILENCE_TIMEOUT_S (3 s) of silence (it sends Stats at least every 100 ms) or a protocol version
mismatch.
After a loss everything is reopened and the connection retried every 100 ms.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from ipc.fifo import CONTROL, REQUESTS, TOKENS, PipeError, grow_pipe, open_reader, try_open_writer
from ipc.framing import encode, encode_control, proxy_decoder
from ipc.records import (
    HEARTBEAT_INTERVAL_S,
    PROTOCOL_VERSION,
    SILENCE_TIMEOUT_S,
    Abort,
    Goodbye,
    Heartbeat,
    Hello,
    ResponseOp,
    Submit,
    ToProxy,
    Welcome,
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
MAX_CONTROL_QUEUE = 4096


class DaemonUnavailable(Exception):
    """The daemon is not connected, or did not take a request in time."""


class ProxyPipes:
    def __init__(self, runtime_dir: Path, epoch: int,
                 on_record: Callable[[ToProxy], None],
                 on_state: Callable[[bool, str], None]) -> None:
        self.epoch = epoch
        self.up = False
        self._paths = {name: Path(runtime_dir) / name for name in (REQUESTS, CONTROL, TOKENS)}
        self._on_record = on_record
        self._on_state = on_state
        self._tokens_fd: int | None = None
        self._control_fd: int | None = None
        self._requests_fd: int | None = None
        self._decoder = proxy_decoder()
        self._bad_before = 0  # bad records counted by decoders of earlier connections
        self._last_record = 0.0
        self._next_heartbeat = 0.0
        self._next_hello = 0.0
        self._retry_at = 0.0
        self._control_queue: collections.deque[bytes] = collections.deque()
        self._submit_lock = asyncio.Lock()
        self._write_waiter: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._nudge: asyncio.Future[None] | None = None  # wakes the supervisor early
        self._loop: asyncio.AbstractEventLoop | None = None
        self._warned: str | None = None

    @property
    def connected(self) -> bool:
        """Write ends open (the daemon may not have welcomed us yet)."""
        return self._control_fd is not None

    @property
    def bad_records(self) -> int:
        return self._bad_before + self._decoder.num_bad

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
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
        if self._control_fd is not None and not self._control_queue:
            try:
                os.write(self._control_fd, encode_control(Goodbye(self.epoch)))
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
        self._warned = None
        log.info("ipc: pipes open, waiting for the daemon's Welcome")
        now = time.monotonic()
        self._say_hello(now)
        self._next_heartbeat = now + HEARTBEAT_S

    def _say_hello(self, now: float) -> None:
        # Repeated until welcomed: a daemon that was not ready to answer may have dropped it.
        self._next_hello = now + HELLO_REPEAT_S
        hello = Hello(version=PROTOCOL_VERSION, pid=os.getpid(), epoch=self.epoch)
        self._send_control(encode_control(hello))

    def _warn_once(self, message: str) -> None:
        if message != self._warned:
            log.warning("ipc: %s; retrying", message)
            self._warned = message

    # -- reading tokens --------------------------------------------------------------------

    def _on_tokens_readable(self) -> None:
        fd = self._tokens_fd
        for _ in range(READS_PER_CALLBACK):
            if fd is None or fd != self._tokens_fd:
                return  # a record handler caused a loss and a reopen
            try:
                data = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                return
            if not data:
                self._on_tokens_eof()
                return
            self._last_record = time.monotonic()
            records = self._decoder.feed(data)
            if self.up:
                self._deliver(records)
            else:
                for record in records:
                    self._dispatch(record)
            if len(data) < READ_CHUNK:
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
        # Anything else before this connection's Welcome is left over from an earlier one.

    def _deliver(self, records: list[ToProxy]) -> None:
        # The hot path (hundreds of thousands of records/s): no per-record checks but one.
        on_record = self._on_record
        for record in records:
            try:
                on_record(record)
            except Exception:
                log.exception("ipc: on_record failed for a %s record", type(record).__name__)
            if not self.up:
                return  # a handler caused a loss: the rest belongs to the old connection

    def _welcome(self, welcome: Welcome) -> None:
        if welcome.version != PROTOCOL_VERSION:
            log.error("ipc: daemon speaks protocol version %d, this proxy speaks %d; "
                      "run matching versions", welcome.version, PROTOCOL_VERSION)
            self._lose(f"protocol version mismatch: daemon {welcome.version}, "
                       f"proxy {PROTOCOL_VERSION}", retry_in=VERSION_RETRY_S, notify=True)
            return
        if welcome.epoch != self.epoch:
            log.warning("ipc: ignoring a Welcome for epoch %d (ours is %d)",
                        welcome.epoch, self.epoch)
            return
        self.up = True
        self._last_record = time.monotonic()
        log.info("ipc: daemon pid %d up (model %s)", welcome.pid, welcome.model)
        self._on_state(True, "connected")
        self._dispatch(welcome)

    # -- writing ---------------------------------------------------------------------------

    def control(self, record: Abort | ResponseOp | Goodbye) -> bool:
        """Send a control record with one atomic write (queued in order if the pipe is full).

        False if the daemon is down or the queue is full (the record is then dropped).
        """
        if not self.up:
            return False
        return self._send_control(encode_control(record))

    def _send_control(self, frame: bytes, droppable: bool = False) -> bool:
        fd = self._control_fd
        if fd is None:
            return False
        if self._control_queue:
            return droppable or self._enqueue_control(frame)
        try:
            os.write(fd, frame)  # <= PIPE_BUF: all or EAGAIN, never a part
        except BlockingIOError:
            if droppable:
                return True
            assert self._loop is not None
            self._loop.add_writer(fd, self._flush_control)
            return self._enqueue_control(frame)
        except BrokenPipeError:
            self._lose("daemon closed the control pipe (EPIPE)")
            return False
        return True

    def _enqueue_control(self, frame: bytes) -> bool:
        if len(self._control_queue) >= MAX_CONTROL_QUEUE:
            log.warning("ipc: control queue full (%d records); dropping one", MAX_CONTROL_QUEUE)
            return False
        self._control_queue.append(frame)
        return True

    def _flush_control(self) -> None:
        fd = self._control_fd
        assert fd is not None and self._loop is not None
        queue = self._control_queue
        while queue:
            try:
                os.write(fd, queue[0])
            except BlockingIOError:
                return
            except BrokenPipeError:
                self._lose("daemon closed the control pipe (EPIPE)")
                return
            queue.popleft()
        self._loop.remove_writer(fd)

    # The timeout parameter is the agreed API (ASYNC109 prefers asyncio.timeout at the caller).
    async def submit(self, record: Submit, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        """Write one Submit frame; DaemonUnavailable if the daemon is down or does not take it
        within ``timeout`` seconds."""
        if not self.up:
            raise DaemonUnavailable("the engine daemon is not connected")
        frame = encode(record)
        try:
            async with asyncio.timeout(timeout):
                async with self._submit_lock:
                    await self._write_request(frame)
        except TimeoutError:
            raise DaemonUnavailable(
                f"requests pipe full: the daemon took nothing for {timeout:g} s") from None

    async def _write_request(self, frame: bytes) -> None:
        view = memoryview(frame)
        done = 0
        try:
            while done < len(view):
                fd = self._requests_fd
                if fd is None:
                    raise DaemonUnavailable("the engine daemon went away")
                try:
                    done += os.write(fd, view[done:])
                except BlockingIOError:
                    await self._writable(fd)
                except BrokenPipeError:
                    self._lose("daemon closed the requests pipe (EPIPE)")
                    raise DaemonUnavailable("the engine daemon went away") from None
        finally:
            if 0 < done < len(view):
                # Half a frame is in the pipe: only a reconnect resynchronises the daemon.
                self._lose("a request frame was left half-written")

    async def _writable(self, fd: int) -> None:
        assert self._loop is not None
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._write_waiter = waiter
        self._loop.add_writer(fd, _wake, waiter)
        try:
            await waiter
        finally:
            self._write_waiter = None
            if self._requests_fd == fd:
                self._loop.remove_writer(fd)

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
        waiter = self._write_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(why)
        self._control_queue.clear()
        for fd in (self._control_fd, self._requests_fd):
            if fd is not None:
                if self._loop is not None:
                    self._loop.remove_writer(fd)
                os.close(fd)
        self._control_fd = self._requests_fd = None


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
