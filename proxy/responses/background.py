"""Background responses: generation that outlives the HTTP request that started it.

A `BackgroundRun` drives one engine session in its own task (``abort_on_exit=False``: a client
leaving does not stop it) and keeps the events it produced, so a background stream, a later
``GET ?stream=true`` and a cancel all see the same sequence. Whatever happens (finish, engine
error, cancel) the run publishes exactly one terminal event, so no reader ever waits forever,
and never one the store will contradict:

- when the connection to the daemon is lost the response may well go on there (the daemon keeps
  background sessions across a new connection), so the run publishes an ``error`` event with
  code ``stream_interrupted``, not an ending, and once the daemon answers again takes the ending
  from the store (`ResponseEvents.settle`): the text not sent yet, then the stored response.
- when the proxy stops, a run is *released*: the daemon goes on with the response (the next proxy
  serves it from the store), and readers here get an ``error`` event saying so before their
  stream ends.

`BackgroundRegistry` bounds what the proxy holds: how many runs, how long finished ones stay for
late readers (a timer, so a quiet proxy lets them go too), and the bytes of their events, all runs
together. Past the byte bound, finished runs are let go oldest first, then the oldest events of
the run that grew; a reader who asks for events let go is told where the held ones start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable

from ipc.reasons import Reason
from ipc.records import Submit
from ipc.response_records import PLACEHOLDER_STATUSES, ResponseGet, ResponseStatus
from proxy.engine.client import EngineClient
from proxy.engine.metrics import RequestTimer
from proxy.http.errors import ApiError
from proxy.responses.event_history import EventHistory
from proxy.responses.events import Event, Outcome, ResponseEvents, apply_record

log = logging.getLogger("tether.proxy")

# How often an interrupted run asks the store whether its response has ended.
SETTLE_POLL_S = 0.5
DEFAULT_HISTORY_BYTES = 64 << 20


class BackgroundRun:
    def __init__(self, events: ResponseEvents) -> None:
        self.events = events
        self.history = EventHistory()
        self.task: asyncio.Task[None] | None = None
        self.finished_at: float | None = None
        self.released = False
        # Lost sight of the engine: the ending will come from the store, and GET asks it.
        self.interrupted = False
        self.on_finished: Callable[[BackgroundRun], None] | None = None
        self.on_grown: Callable[[BackgroundRun, int], None] | None = None
        self._wake = asyncio.Event()
        self.publish(events.created())

    @property
    def id(self) -> str:
        return self.events.params.id

    @property
    def finished(self) -> bool:
        return self.events.finished

    def start(self, engine: EngineClient, submit: Submit,
              timer: RequestTimer | None = None) -> None:
        self.task = asyncio.create_task(self._drive(engine, submit, timer),
                                        name=f"background {self.id}")

    def publish(self, events: list[Event]) -> None:
        if not events:
            return
        added = self.history.append(events)
        if self.finished and self.finished_at is None:
            self.finished_at = time.monotonic()
            if self.on_finished is not None:
                self.on_finished(self)
        if self.on_grown is not None:
            self.on_grown(self, added)
        # Each waiter holds the Event current when it checked; swapping wakes them all at once.
        self._wake.set()
        self._wake = asyncio.Event()

    def release(self) -> None:
        """The proxy stops; the response does not. Ends every reader's stream, stops the task."""
        if self.finished or self.released:
            return
        self.released = True
        self.publish(self.events.error(
            f"this server is restarting, so this stream ends here; the response goes on: "
            f"GET /v1/responses/{self.id} shows it", "server_restarting", None))
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()

    def end(self, outcome: Outcome) -> None:
        """Finish now (a cancel) unless the run already finished; stops the task."""
        self.publish(self.events.finish(outcome))
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()

    def subscribe(self, starting_after: int = -1) -> AsyncGenerator[list[Event], None]:
        """Every event after ``starting_after`` (all of them by default) until the terminal one,
        in lists: all that were published since the reader last asked. A live run may be asked
        for events it has not sent yet: if it ends before them, the reader gets its last event.
        ApiError(400) at once for events an ended run never sent, or ones it no longer holds."""
        last, first = len(self.history) - 1, self.history.first
        if starting_after > last and (self.finished or self.released):
            raise ApiError(400, f"'starting_after' is {starting_after}, but the last event of "
                           f"response {self.id} is {last}", param="starting_after")
        if starting_after + 1 < first:
            raise ApiError(400, self._let_go(first), param="starting_after")
        return self._follow(starting_after + 1)

    async def _follow(self, i: int) -> AsyncGenerator[list[Event], None]:
        while True:
            if i < self.history.first:  # this reader fell behind what the run could hold
                yield [{"type": "error", "sequence_number": self.history.first - 1,
                        "code": "events_let_go", "message": self._let_go(self.history.first),
                        "param": None}]
                return
            if i < len(self.history):
                batch = self.history.since(i)
                i += len(batch)
                yield batch
                continue
            if self.finished or self.released:
                if i > len(self.history):  # it ended before the events this reader asked for
                    yield [self.history[-1]]
                return
            await self._wake.wait()

    def _let_go(self, first: int) -> str:
        return (f"events before {first} of response {self.id} are no longer held (the proxy "
                f"keeps a bounded history of events): resume with starting_after={first - 1} "
                f"or later, or GET /v1/responses/{self.id}")

    async def _drive(self, engine: EngineClient, submit: Submit,
                     timer: RequestTimer | None) -> None:
        try:
            if not await self._generate(engine, submit, timer):
                await self._settle(engine)
        except asyncio.CancelledError:
            # A cancel ends the run before it stops the task; otherwise the proxy is stopping.
            self.release()
            raise
        except Exception as exc:
            log.exception("background response %s failed", self.id)
            self.publish(self.events.finish(Outcome(ResponseStatus.FAILED, error=str(exc))))
        finally:
            if not self.released:
                # The engine ended the stream without a Finish: still give readers their ending.
                self.publish(self.events.finish(Outcome(
                    ResponseStatus.FAILED, error="generation ended without a result")))

    async def _generate(self, engine: EngineClient, submit: Submit,
                        timer: RequestTimer | None) -> bool:
        """Publishes the engine's records as events; False if the daemon was lost on the way."""
        try:
            async with contextlib.aclosing(engine.generate(submit, abort_on_exit=False)) as batches:
                async for batch in batches:
                    if timer is not None:
                        timer.see(batch)
                    for record in batch:
                        self.publish(apply_record(self.events, record))
        except ApiError as exc:
            if exc.code == "engine_unavailable":  # engine.client.unavailable: not an ending
                return False
            # Refused or timed out: the store holds no running response either.
            self.publish(self.events.error(exc.message, exc.code, exc.param))
            self.publish(self.events.finish(Outcome(ResponseStatus.FAILED, error=exc.message)))
            return True
        if timer is not None:
            timer.done()
        return True

    async def _settle(self, engine: EngineClient) -> None:
        """The daemon was lost with the response under way, and may well go on with it: tell
        the readers so, then end as the store says once the daemon answers again."""
        self.interrupted = True
        self.publish(self.events.error(
            f"the connection to the engine was interrupted; the response may go on: this "
            f"stream resumes with its ending once the engine is back (GET "
            f"/v1/responses/{self.id} shows it)", "stream_interrupted", None))
        while True:
            await asyncio.sleep(SETTLE_POLL_S)
            if not engine.up:
                continue
            try:
                reply = await engine.response_op(ResponseGet(self.id))
            except ApiError:
                continue  # lost again: keep asking
            if reply.reason is Reason.NOT_FOUND:
                # Never admitted: its Submit, of an earlier connection, never will be.
                self.publish(self.events.finish(Outcome(
                    ResponseStatus.FAILED, error="the engine was lost before it took this "
                    "response")))
                return
            stored = reply.response
            if stored is not None and stored.status not in PLACEHOLDER_STATUSES:
                self.publish(self.events.settle(stored))
                return


class BackgroundRegistry:
    """The background runs this proxy holds, bounded in number, in how long finished ones stay
    and in the bytes of their events."""

    def __init__(self, max_runs: int = 1024, keep_finished_s: float = 600.0,
                 max_history_bytes: int = DEFAULT_HISTORY_BYTES) -> None:
        self.max_runs = max_runs
        self.keep_finished_s = keep_finished_s
        self.max_history_bytes = max_history_bytes
        self.history_bytes = 0  # of every run held
        self._runs: OrderedDict[str, BackgroundRun] = OrderedDict()
        self._finished: OrderedDict[str, BackgroundRun] = OrderedDict()  # in the order they ended
        # A finished run's expiry: cancelled whenever the run leaves early, so that nothing
        # keeps a dropped run (and its whole event history) alive until its time is up.
        self._expiries: dict[str, asyncio.TimerHandle] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def get(self, response_id: str) -> BackgroundRun | None:
        return self._runs.get(response_id)

    def remove(self, response_id: str) -> None:
        run = self._runs.pop(response_id, None)
        if run is not None:
            self.history_bytes -= run.history.nbytes
        self._finished.pop(response_id, None)
        expiry = self._expiries.pop(response_id, None)
        if expiry is not None:
            expiry.cancel()

    def add(self, run: BackgroundRun) -> None:
        """Raises ApiError(429) when every slot holds a run still generating."""
        self._prune(time.monotonic())
        if len(self._runs) >= self.max_runs:
            raise ApiError(429, f"too many background responses in progress (limit "
                                f"{self.max_runs}); retry later", code="rate_limit_exceeded")
        self._runs[run.id] = run
        self.history_bytes += run.history.nbytes
        run.on_finished = self._ended
        run.on_grown = self._grown
        self._grown(run, 0)

    def _ended(self, run: BackgroundRun) -> None:
        if self._runs.get(run.id) is not run:
            return
        self._finished[run.id] = run
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): the prune in add() still applies
            return
        self._expiries[run.id] = loop.call_later(self.keep_finished_s, self.remove, run.id)

    def _grown(self, run: BackgroundRun, added: int) -> None:
        """Past the byte bound: let finished runs go, oldest first, then `run`'s oldest events."""
        if self._runs.get(run.id) is not run:
            return  # removed (deleted, cancelled): its bytes no longer count
        self.history_bytes += added
        for other in list(self._finished.values()):
            if self.history_bytes <= self.max_history_bytes:
                return
            if other is not run:
                self.remove(other.id)
        if self.history_bytes > self.max_history_bytes:
            self.history_bytes -= run.history.let_go(self.history_bytes - self.max_history_bytes)

    def _prune(self, now: float) -> None:
        finished = list(self._finished.values())
        expired = [r for r in finished if now - (r.finished_at or now) > self.keep_finished_s]
        for run in expired:
            self.remove(run.id)
        excess = len(self._runs) - self.max_runs + 1
        for run in [r for r in finished if r not in expired][:max(excess, 0)]:
            self.remove(run.id)

    def release_all(self) -> None:
        for run in self._runs.values():
            run.release()

    async def close(self) -> None:
        """Proxy shutdown: every unfinished run released, and its task awaited."""
        tasks = [r.task for r in self._runs.values() if r.task is not None and not r.task.done()]
        self.release_all()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
