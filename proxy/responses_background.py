"""Background responses: generation that outlives the HTTP request that started it.

A `BackgroundRun` drives one engine session in its own task (``abort_on_exit=False``: a client
leaving does not stop it) and keeps every event it produced, so a background stream, a later
``GET ?stream=true`` and a cancel all see the same sequence. Whatever happens (finish, engine
error, daemon lost, cancel) the run publishes exactly one terminal event, so no reader ever
waits forever. When the proxy stops, a run is *released*: the daemon goes on with the response
(the next proxy serves it from the store), and readers here get an ``error`` event saying so
before their stream ends.

`BackgroundRegistry` bounds how many runs the proxy holds: finished runs are kept a while for
late readers, then dropped when that time is up (a timer, so a quiet proxy lets them go too), or
oldest first when a new run needs the room.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable

from ipc.records import ResponseStatus, Submit
from proxy.engine_client import EngineClient
from proxy.errors import ApiError
from proxy.metrics import RequestTimer
from proxy.responses_events import Event, Outcome, ResponseEvents, apply_record

log = logging.getLogger("tether.proxy")


class BackgroundRun:
    def __init__(self, events: ResponseEvents) -> None:
        self.events = events
        self.history: list[Event] = []
        self.task: asyncio.Task[None] | None = None
        self.finished_at: float | None = None
        self.released = False
        self.on_finished: Callable[[BackgroundRun], None] | None = None
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
        self.history.extend(events)
        if self.finished and self.finished_at is None:
            self.finished_at = time.monotonic()
            if self.on_finished is not None:
                self.on_finished(self)
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

    async def subscribe(self, starting_after: int | None = None
                        ) -> AsyncGenerator[list[Event], None]:
        """Every event after ``starting_after`` (all of them by default), until the terminal one,
        in lists: all that were published since the reader last asked."""
        i = 0 if starting_after is None else starting_after + 1
        while True:
            while i < len(self.history):
                batch = self.history[i:]
                i += len(batch)
                yield batch
            if self.finished or self.released:
                return
            await self._wake.wait()

    async def _drive(self, engine: EngineClient, submit: Submit,
                     timer: RequestTimer | None) -> None:
        try:
            async with contextlib.aclosing(engine.generate(submit, abort_on_exit=False)) as batches:
                async for batch in batches:
                    if timer is not None:
                        timer.see(batch)
                    for record in batch:
                        self.publish(apply_record(self.events, record))
            if timer is not None:
                timer.done()
        except ApiError as exc:
            self.publish(self.events.error(exc.message, exc.code, exc.param))
            self.publish(self.events.finish(Outcome(ResponseStatus.FAILED, error=exc.message)))
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


class BackgroundRegistry:
    """The background runs this proxy holds, bounded in number and in how long finished ones stay."""

    def __init__(self, max_runs: int = 1024, keep_finished_s: float = 600.0) -> None:
        self.max_runs = max_runs
        self.keep_finished_s = keep_finished_s
        self._runs: OrderedDict[str, BackgroundRun] = OrderedDict()
        # A finished run's expiry: cancelled whenever the run leaves early, so that nothing
        # keeps a dropped run (and its whole event history) alive until its time is up.
        self._expiries: dict[str, asyncio.TimerHandle] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def get(self, response_id: str) -> BackgroundRun | None:
        return self._runs.get(response_id)

    def remove(self, response_id: str) -> None:
        self._runs.pop(response_id, None)
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
        run.on_finished = self._expire_later

    def _expire_later(self, run: BackgroundRun) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): the prune in add() still applies
            return
        if self._runs.get(run.id) is run:
            self._expiries[run.id] = loop.call_later(self.keep_finished_s, self.remove, run.id)

    def _prune(self, now: float) -> None:
        finished = [r for r in self._runs.values() if r.finished_at is not None]
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
