"""Bystander streams: well-behaved streaming clients run in threads beside a fault, so a test can
assert that every one of them completed (status 200, no error event, ``[DONE]`` at the end)."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from tests.support.raw_http import sse_json

STREAM = {"max_tokens": 64, "ignore_eos": True, "temperature": 0, "stream": True}


@dataclass
class StreamResult:
    status: int = 0
    events: int = 0
    done: bool = False  # the stream ended with [DONE]
    error: str | None = None  # an error event, a non-200 body, or the client's exception
    max_gap_s: float = 0.0  # the longest wait between two events, after the first
    stopped: bool = False  # its own client ended it early (Bystanders.stop), as asked

    @property
    def ok(self) -> bool:
        return self.status == 200 and (self.done or self.stopped) and self.error is None


def stream_once(url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                timeout: float = 120.0, until: threading.Event | None = None) -> StreamResult:
    """One stream read to its end, or until `until` is set."""
    result = StreamResult()
    try:
        with httpx.stream("POST", url + path, json=body, headers=headers, timeout=timeout) as r:
            result.status = r.status_code
            if r.status_code != 200:
                result.error = r.read().decode(errors="replace")
                return result
            last: float | None = None
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    result.done = True
                event = sse_json(line)
                if event is None:
                    continue
                now = time.monotonic()
                if last is not None:
                    result.max_gap_s = max(result.max_gap_s, now - last)
                last = now
                result.events += 1
                if until is not None and until.is_set():
                    result.stopped = True
                    break
                if "error" in event:
                    result.error = orjson.dumps(event).decode()
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


@dataclass
class Bystanders:
    """`count` streams of `body` on `path`, each in its own thread, started at once."""

    url: str
    count: int
    path: str = "/v1/completions"
    body: dict[str, Any] = field(default_factory=lambda: {"prompt": "a bystander", **STREAM})
    results: list[StreamResult] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Bystanders:
        self.results = [StreamResult() for _ in range(self.count)]
        for i in range(self.count):
            thread = threading.Thread(target=self._run, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _run(self, i: int) -> None:
        self.results[i] = stream_once(self.url, self.path, self.body, until=self._stop)

    def running(self) -> int:
        """How many streams are still going."""
        return sum(1 for thread in self._threads if thread.is_alive())

    def stop(self) -> list[StreamResult]:
        """Ends every stream still going at its next event (each `stopped`, not failed)."""
        self._stop.set()
        return self.join()

    def join(self, timeout: float = 180.0) -> list[StreamResult]:
        for thread in self._threads:
            thread.join(timeout)
            assert not thread.is_alive(), "a bystander stream never ended"
        return self.results

    def assert_all_ok(self, timeout: float = 180.0) -> None:
        bad = [r for r in self.join(timeout) if not r.ok]
        assert not bad, f"{len(bad)} of {self.count} bystander streams failed: {bad[:3]}"


@dataclass
class Paced:
    """One streaming chat client in a thread that notes when each event arrives: the longest
    gap between two events of a window says what a fault cost a bystander."""

    url: str
    headers: dict[str, str] = field(default_factory=dict)
    arrivals: list[float] = field(default_factory=list)
    error: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self, first_events: int = 5, timeout: float = 60.0) -> Paced:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while len(self.arrivals) < first_events:
            assert self.error is None and time.monotonic() < deadline, self.error
            time.sleep(0.01)
        return self

    def _run(self) -> None:
        body = {"messages": [{"role": "user", "content": "a bystander"}], "max_tokens": 30_000,
                "ignore_eos": True, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body,
                              headers=self.headers, timeout=60.0) as r:
                if r.status_code != 200:
                    self.error = r.read().decode(errors="replace")
                    return
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.arrivals.append(time.monotonic())
                    if self._stop.is_set():
                        return
            self.error = "the stream ended before it was stopped"
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def longest_gap(self, since: float) -> float:
        """The longest wait for an event from `since` to now (the wait still open included)."""
        now = time.monotonic()
        before = [t for t in self.arrivals if t < since][-1:]
        times = before + [t for t in self.arrivals if t >= since] + [now]
        return max(b - a for a, b in itertools.pairwise(times))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        assert self.error is None, self.error
