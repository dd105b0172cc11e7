"""A token stream written to its client from the callback that routes its records.

The request's task does not carry each token to the socket: the session's sink renders what is
waiting and hands it to the ASGI ``send`` right in the tokens callback, once per read of the
tokens pipe. No task switch, no generators and no trip down the middleware chain per write, and
the writes of one read go out back to back, which keeps the clients' readers awake between
them. A send runs to its end there when the socket takes the bytes at once, as it does for a
client that keeps up; one that has to wait (uvicorn's flow control: the client fell behind) is
finished by the request's task, and whatever arrives meanwhile waits in the session, counted by
flow control, to go out in one write once it has.

The task otherwise waits, inside the request's DisconnectWatch: for the end of the stream, or
for the client to leave, when closing the session writes the Abort at once.

The contract of the ASGI ``send``, all of it on the event loop's thread:
- the request's task (`__call__`) awaits ``send`` for ``http.response.start`` alone;
- every ``http.response.body`` is begun by the sink, `_write`, which steps ``send(message)`` once
  by hand: mostly outside any task, in the tokens pipe's reader callback (``loop.add_reader`` ->
  ipc/connection/proxy.py's ``_deliver`` -> `EngineClient._on_delivered` -> `Session.wake` ->
  `_pump`) or the keepalive's timer callback; in the request's task only for the records waiting
  when the stream starts and after it finished a send;
- a send that suspends there (the transport is paused) is handed to the request's task, which
  drives it to its end (`_finish_send`), then pumps again;
- so at most one send is under way at any moment (``_pending``), and the message order is the
  order of the sink's writes. A request that does not stream is sent by Starlette's `Response`,
  from the request's task (proxy/engine/exchange.py).

A stream may ask for a keepalive (the Messages API's ``ping``): an event written, from a timer
callback on the loop, whenever nothing has been written for its interval, so that a client (or a
proxy between) that times out an idle stream keeps it while the engine is slow to the next token.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Generator
from typing import Any, NamedTuple, Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from proxy.engine.batching import Batch
from proxy.engine.client import EngineClient
from proxy.engine.metrics import RequestTimer
from proxy.engine.session import Session
from proxy.http.cancellation import DisconnectWatch
from proxy.http.errors import ApiError, ClientDisconnected
from proxy.http.sse import SSE_HEADERS


class Keepalive(NamedTuple):
    event: bytes  # written when the stream has been idle
    interval_s: float


class StreamAnswer(Protocol):
    """What a stream needs of its endpoint's answer."""

    @property
    def ok(self) -> bool:
        """The engine ended the request as it should (not aborted, not failed)."""

    def render(self, batch: Batch) -> tuple[bytes, bool]:
        """A batch's stream events, and whether they end the stream."""

    def error(self, exc: ApiError) -> bytes:
        """The event that ends a stream whose request failed."""


class TokenStream(Response):
    media_type = "text/event-stream"

    def __init__(self, engine: EngineClient, session: Session, answer: StreamAnswer,
                 timer: RequestTimer, first: Batch, watch: DisconnectWatch,
                 keepalive: Keepalive | None = None) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(SSE_HEADERS)
        self._engine = engine
        self._session = session
        self._answer = answer
        self._timer = timer
        self._first = first
        self._watch = watch
        self._send: Send | None = None
        # A send that had to wait, and what it waits on: finished by the task.
        self._pending: tuple[Generator[Any, None, None], Any] | None = None
        self._final = False  # the send under way ends the stream
        self._ended = False
        self._error: BaseException | None = None
        self._wake: asyncio.Future[None] | None = None  # the task waits here
        self._keepalive = keepalive
        self._idle: asyncio.TimerHandle | None = None  # the keepalive's next look
        self._last_write = 0.0  # the loop's time of the last write begun

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._send = send
        try:
            with self._watch:
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                first, self._first = self._first, []
                if first:
                    self._render(first)
                self._session.sink = self._pump
                self._pump()
                self._look_idle()
                await self._serve()
        except ClientDisconnected:
            pass  # nobody is left to answer
        finally:
            self._ended = True
            if self._idle is not None:
                self._idle.cancel()
            self._watch.close()
            if self._pending is not None:
                self._pending[0].close()
                self._pending = None
            self._engine.close_session(self._session)

    async def _serve(self) -> None:
        """The task's part: finish sends that had to wait, until the stream ends."""
        loop = asyncio.get_running_loop()
        while True:
            if self._pending is not None:
                await self._finish_send(*self._pending)
                continue
            if self._error is not None:
                raise self._error
            if self._ended:
                return
            self._wake = loop.create_future()
            await self._wake
            self._wake = None

    # --- the sink: runs in the tokens callback (or the task), never waits ----------------------

    def _pump(self) -> None:
        """Writes what is waiting for the client, unless a send is under way."""
        if self._pending is not None or self._ended:
            return
        try:
            try:
                batch = self._session.take()
            except ApiError as exc:
                self._write(self._answer.error(exc), True)
                return
            if batch or self._session.complete:
                self._render(batch)
        except Exception as exc:
            self._fail(exc)

    def _render(self, batch: Batch) -> None:
        self._timer.see(batch)
        self._write(*self._answer.render(batch))

    def _look_idle(self) -> None:
        """The keepalive's timer: writes its event when nothing was written for its interval
        (and no send is under way), and looks again an interval after the last write."""
        self._idle = None
        if self._keepalive is None or self._ended:
            return
        loop = asyncio.get_running_loop()
        interval = self._keepalive.interval_s
        if self._pending is None and loop.time() - self._last_write >= interval:
            self._write(self._keepalive.event, False)
        self._idle = loop.call_at(max(self._last_write, loop.time() - interval) + interval,
                                  self._look_idle)

    def _write(self, data: bytes, final: bool) -> None:
        assert self._send is not None
        self._final = final
        if self._keepalive is not None:
            self._last_write = asyncio.get_running_loop().time()
        message = {"type": "http.response.body", "body": data, "more_body": not final}
        try:
            call = self._send(message).__await__()
            waiting_on = call.send(None)
        except StopIteration:
            self._sent()
            return
        except Exception as exc:
            self._fail(exc)
            return
        self._pending = (call, waiting_on)
        self._wake_task()

    def _sent(self) -> None:
        self._session.handed_on()
        if self._final:
            self._ended = True
            if self._answer.ok:
                self._timer.done()
            self._wake_task()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._ended = True
        self._wake_task()

    def _wake_task(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _finish_send(self, call: Generator[Any, None, None], waiting_on: Any) -> None:
        """Drives a send that suspended to its end, as a task of its own would have: resumes it
        each time the future it yielded is done (a bare yield only gave way to the loop)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                if waiting_on is None:
                    await asyncio.sleep(0)
                else:
                    # Not awaited a second time (the send's own await already marked it).
                    resumed = loop.create_future()
                    waiting_on.add_done_callback(functools.partial(_settle, resumed))
                    await resumed
                waiting_on = call.send(None)
        except StopIteration:
            pass
        self._pending = None
        self._sent()
        self._pump()


def _settle(waiter: asyncio.Future[None], _done: object) -> None:
    if not waiter.done():
        waiter.set_result(None)
