"""The proxy's side of the daemon connection, on top of its pipes (ipc/proxy_side.py).

The daemon is "up" once the write ends are open and its Welcome for this connection (the nonce
of our Hello) has arrived: it assigns the connection's epoch and says what model is served.
The connection owns the epoch: it stamps it on every record it writes, as it writes or queues
it, and a connection that is lost fails what it had queued, so a record made for one connection
is never written on the next. The daemon is lost on EOF on tokens, EPIPE on a write,
SILENCE_TIMEOUT_S (3 s) of silence (it sends Stats or Alive at least every 250 ms) or a protocol
version mismatch (its Welcome says so, or the Error by which it refuses our Hello). After a loss
everything is reopened and the connection retried every 100 ms.

Our heartbeats come from a thread of their own (as the daemon's keepalive thread speaks for a
long forward pass), so the daemon hears from us however long the event loop is busy: liveness
never depends on the loop being free. A loop that truly hangs (a deadlock, a callback that never
returns) is caught elsewhere: it stops reading tokens, so the daemon drops us once the pipe has
stayed full for its stall bound, and it stops the watchdog pings (systemd's or the launcher's,
sent from the loop), so we are killed and restarted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ipc.framing import encode, encode_control
from ipc.loss import Loss, LossReason
from ipc.proxy_side import DaemonUnavailable, ProxyPipes
from ipc.proxy_writers import OutFrame
from ipc.records import (
    HEARTBEAT_INTERVAL_S,
    PROTOCOL_VERSION,
    SILENCE_TIMEOUT_S,
    VERSION_MISMATCH,
    Abort,
    AbortCause,
    Error,
    Goodbye,
    Heartbeat,
    Hello,
    Pause,
    Resume,
    Submit,
    Welcome,
    version_mismatch,
)
from ipc.response_records import ResponseOp
from ipc.wire import ToProxy

log = logging.getLogger("tether.ipc")

RETRY_S = 0.1
VERSION_RETRY_S = 5.0  # a mismatched daemon will not change its mind in 100 ms
HEARTBEAT_S = HEARTBEAT_INTERVAL_S
HELLO_REPEAT_S = 1.0
SILENCE_S = SILENCE_TIMEOUT_S
TICK_S = 0.05
CLOCK_SLACK_S = 0.002

# Called with None once the daemon is up, with the Loss once it is lost (or refuses us).
OnState = Callable[[Loss | None], None]


class ProxyConnection:
    def __init__(self, runtime_dir: Path, on_record: Callable[[ToProxy], None],
                 on_state: OnState, on_delivered: Callable[[], None] | None = None) -> None:
        self.epoch = 0  # the current connection's, assigned by the daemon's Welcome
        self.up = False
        self.welcome: Welcome | None = None  # the last daemon's: the model it serves
        self.loss: Loss | None = None  # why the daemon went away, last time it did
        self.pipes = ProxyPipes(runtime_dir, self._on_read, self._lose)
        self._on_record = on_record
        self._on_state = on_state
        # After each read's records were all handed to on_record: a consumer that routes them
        # to many readers wakes each once per read, not once per record.
        self._on_delivered = on_delivered
        self._last_record = 0.0
        self._next_hello = 0.0
        self._retry_at = 0.0
        self._nonce = 0  # this connection's, echoed by its Welcome
        self._task: asyncio.Task[None] | None = None
        self._nudge: asyncio.Future[None] | None = None  # wakes the supervisor early
        self._mismatch_logged: str | None = None
        self._closing = threading.Event()
        self._heart = threading.Thread(target=self._beat, name="tether-heartbeat", daemon=True)

    @property
    def connected(self) -> bool:
        """Write ends open (the daemon may not have welcomed us yet)."""
        return self.pipes.connected

    @property
    def down_reason(self) -> str:
        return self.loss.detail if self.loss is not None else "the daemon has not connected yet"

    @property
    def bad_records(self) -> int:
        return self.pipes.bad_records

    @property
    def aborts_written(self) -> dict[AbortCause, int]:
        """Abort records actually written into the control pipe, by cause."""
        return self.pipes.aborts_written

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self.pipes.start(asyncio.get_running_loop())
        self._connect()
        self._task = asyncio.create_task(self._supervise(), name="tether-ipc-supervisor")
        self._heart.start()

    def _beat(self) -> None:
        """The heartbeat thread: one Heartbeat every interval while the write ends are open."""
        while not self._closing.wait(HEARTBEAT_S):
            self.pipes.beat(encode_control(Heartbeat(self.epoch, time.monotonic())))

    async def close(self) -> None:
        self._closing.set()
        if self._heart.is_alive():
            self._heart.join()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self.up and self.pipes.control_idle:
            try:
                self.pipes.send_control(encode_control(Goodbye(self.epoch)))
            except OSError:
                pass  # the daemon is gone or busy: it will see EOF either way
        self.up = False
        self.pipes.close(DaemonUnavailable("proxy is shutting down"))

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        delay = TICK_S
        while True:
            # A timer, or _lose, wakes us: while up nothing is due before the silence
            # deadline, so the loop is not woken 20 times a second for nothing.
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
        """Reconnect, greet and watch for silence; returns when to look again."""
        pipes = self.pipes
        if not pipes.tokens_open:
            pipes.open_tokens()
        if not pipes.connected:
            if now >= self._retry_at:
                self._retry_at = now + RETRY_S
                self._connect()
            return TICK_S
        if not self.up and now >= self._next_hello:
            self._say_hello(now)
        if self.up and now - self._last_record > SILENCE_S:
            # Look in the pipe first: stopped between this wake-up and the loop's next poll,
            # we would take the records waiting there for silence.
            pipes.read_tokens()
            if self.up and now - self._last_record > SILENCE_S:
                self._lose(Loss(LossReason.SILENCE, f"no record from the daemon for {SILENCE_S:g} s"))
        if not self.up:
            return TICK_S
        # Records only move the silence deadline later, so waking at it misses nothing (the
        # slack covers a loop clock of millisecond resolution).
        return max(self._last_record + SILENCE_S - now, 0.0) + CLOCK_SLACK_S

    # -- the handshake ---------------------------------------------------------------------

    def _connect(self) -> None:
        """Open the write ends, then say Hello under a new nonce."""
        if not self.pipes.try_connect():
            return
        self._nonce = random.getrandbits(62) + 1
        log.info("ipc: pipes open, waiting for the daemon's Welcome")
        self._say_hello(time.monotonic())

    def _say_hello(self, now: float) -> None:
        # Repeated until welcomed: a daemon that was not ready to answer may have dropped it.
        self._next_hello = now + HELLO_REPEAT_S
        hello = Hello(version=PROTOCOL_VERSION, pid=os.getpid(), epoch=self.epoch + 1,
                      nonce=self._nonce)
        self.pipes.send_control(encode_control(hello))

    def _on_read(self, records: list[ToProxy]) -> None:
        self._last_record = time.monotonic()
        if self.up:
            # A stopping daemon's Goodbye is the last record it writes, so the last of its read:
            # one check a read, not one a record.
            goodbye = records[-1] if records and type(records[-1]) is Goodbye else None
            self._deliver(records[:-1] if goodbye else records)
            if goodbye is not None and self.up and goodbye.epoch == self.epoch:
                self._lose(Loss(LossReason.STOPPED, "the daemon stopped (it said goodbye)"))
        else:
            for record in records:
                self._dispatch(record)

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
        self.welcome = welcome
        self.up = True
        self._last_record = time.monotonic()
        log.info("ipc: daemon pid %d up (model %s), epoch %d", welcome.pid, welcome.model,
                 welcome.epoch)
        self._on_state(None)
        self._dispatch(welcome)

    def _refused(self, error: Error) -> None:
        """A daemon-wide Error before the Welcome: a refusal of our Hello (another protocol
        version) ends the connection; anything else is only logged."""
        if error.code == VERSION_MISMATCH:
            self._mismatch(error.message)
        else:
            log.error("ipc: daemon error: %s", error.message)

    def _mismatch(self, message: str) -> None:
        if message != self._mismatch_logged:  # retried every few seconds: said once
            log.error("ipc: %s", message)
            self._mismatch_logged = message
        self._lose(Loss(LossReason.VERSION_MISMATCH, message), retry_in=VERSION_RETRY_S,
                   notify=True)

    # -- writing ---------------------------------------------------------------------------

    def control(self, record: Abort | Pause | Resume | ResponseOp) -> bool:
        """Send a control record, stamped with this connection's epoch, with one atomic write
        (queued in order if the pipe is full).

        False if the daemon is down or the queue is full (the record is then dropped).
        """
        if not self.up:
            return False
        record.epoch = self.epoch
        cause = record.cause if isinstance(record, Abort) else None
        return self.pipes.send_control(encode_control(record), abort=cause)

    def queue_submit(self, record: Submit | ResponseOp) -> OutFrame:
        """Queue one Submit frame (or a conversation's ResponseOp, which can be as big), stamped
        with this connection's epoch; it goes out whole, whatever becomes of the caller, or fails
        with this connection. DaemonUnavailable if the daemon is down."""
        if not self.up:
            raise DaemonUnavailable("the engine daemon is not connected")
        record.epoch = self.epoch
        return self.pipes.put_request(encode(record))

    def withdraw(self, frame: OutFrame) -> bool:
        """Take back a queued Submit not yet started: then the daemon never sees it."""
        return self.pipes.withdraw(frame)

    # The timeout parameter is the agreed API (ASYNC109 prefers asyncio.timeout at the caller).
    async def submit(self, record: Submit, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        """Write one Submit frame and wait until it is wholly in the pipe; DaemonUnavailable if
        the daemon is down or nothing of it went out within ``timeout`` seconds."""
        frame = self.queue_submit(record)
        try:
            async with asyncio.timeout(timeout):
                await self.pipes.wait(frame)
        except TimeoutError:
            if self.withdraw(frame):
                raise DaemonUnavailable(
                    f"requests pipe full: the daemon took nothing for {timeout:g} s") from None
            await self.pipes.wait(frame)  # started: it is finished whatever happens

    # -- losing the daemon -----------------------------------------------------------------

    def _lose(self, loss: Loss, retry_in: float = RETRY_S, notify: bool = False) -> None:
        """Drop the connection and start retrying; on_state hears of it if we were up."""
        if not self.connected:
            return
        was_up, self.up = self.up, False
        if loss.reason is LossReason.STOPPED:
            log.info("ipc: %s", loss.detail)
        else:
            log.warning("ipc: daemon lost: %s", loss.detail)
        self.pipes.disconnect(DaemonUnavailable(f"the engine daemon went away: {loss.detail}"))
        self._retry_at = time.monotonic() + retry_in
        if self._nudge is not None:
            _wake(self._nudge)  # back to ticking at once, to reconnect on time
        if was_up or notify:
            self.loss = loss
            self._on_state(loss)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
