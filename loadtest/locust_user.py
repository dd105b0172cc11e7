"""The load test's client: a locust HttpUser speaking OpenAI's APIs that reads SSE streams,
leaves early when its plan says so, counts what it dropped in the tally and reports TTFT,
inter-token latency and tokens/s per stream as METRIC rows."""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Iterator
from typing import Any

import gevent
from locust import HttpUser, between, events

from loadtest.locust_tally import TALLY

TERMINAL_RESPONSE_EVENTS = ("response.completed", "response.incomplete", "response.cancelled",
                            "response.failed")


def _opt(user: HttpUser, name: str) -> Any:
    return getattr(user.environment.parsed_options, name)


class Drop:
    """When a leaving client goes: after some tokens, or after some time (whichever set)."""

    def __init__(self, max_tokens: int) -> None:
        self.after_tokens: int | None = None
        self.after_s: float | None = None
        if random.random() < 0.5:
            self.after_tokens = random.randint(1, max(1, max_tokens - 1))
        else:
            self.after_s = random.uniform(0.01, 0.5)


class OpenAIUser(HttpUser):
    abstract = True
    wait_time = between(0.05, 0.3)
    kind = "base"

    # --- helpers ------------------------------------------------------------------------------

    def plan(self) -> Drop | None:
        if random.random() < _opt(self, "lt_churn"):
            return Drop(self.max_tokens)
        return None

    @property
    def max_tokens(self) -> int:
        return int(_opt(self, "lt_max_tokens"))

    @property
    def model(self) -> str:
        return str(_opt(self, "lt_model"))

    def metric(self, name: str, value: float) -> None:
        events.request.fire(request_type="METRIC", name=f"{name} {self.kind}",
                            response_time=value, response_length=0, exception=None, context={})

    def stream(self, path: str, body: dict[str, Any], drop: Drop | None, sequences: int,
               expect_tokens: int | None) -> dict[str, Any] | None:
        """POSTs a streaming request and reads it; returns the final usage when it ends."""
        start = time.perf_counter()
        times: list[float] = []
        usage: dict[str, Any] | None = None
        with self.client.post(path, json=body, stream=True, catch_response=True,
                              name=f"{path} stream", timeout=60) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return None
            done = False
            try:
                done, usage = self.read_events(resp, drop, times)
                resp.success()
            finally:
                if not done:
                    resp.close()
                    TALLY.drop(self.kind if drop else f"{self.kind} (stopped)", sequences)
        self.stream_metrics(start, times, dropped=not done)
        if done and expect_tokens is not None and usage is not None:
            got = usage.get("completion_tokens", usage.get("output_tokens"))
            if got != expect_tokens:
                TALLY.usage_mismatch += 1
        return usage if done else None

    def read_events(self, resp: Any, drop: Drop | None,
                    times: list[float]) -> tuple[bool, dict[str, Any] | None]:
        """Reads SSE until the end or the planned departure; (ended, usage)."""
        usage = None
        timer = gevent.Timeout(drop.after_s) if drop and drop.after_s else None
        try:
            if timer is not None:
                timer.start()
            for line in resp.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return True, usage
                obj = json.loads(data)
                times.extend([time.perf_counter()] * _tokens(obj))
                usage = obj.get("usage") or (obj.get("response") or {}).get("usage") or usage
                if obj.get("type") == "response.failed":
                    resp.failure(f"response.failed: {data[:200]!r}")
                if obj.get("type") in TERMINAL_RESPONSE_EVENTS:
                    return True, usage
                if drop and drop.after_tokens is not None and len(times) >= drop.after_tokens:
                    return False, usage
        except gevent.Timeout as exc:
            if exc is not timer:
                raise
        finally:
            if timer is not None:
                timer.close()
        return False, usage

    def stream_metrics(self, start: float, times: list[float], dropped: bool) -> None:
        if dropped:
            self.metric("disconnect", (time.perf_counter() - start) * 1000)
        if not times:
            return
        self.metric("ttft_ms", (times[0] - start) * 1000)
        if len(times) > 1:
            span = times[-1] - times[0]
            self.metric("itl_ms", span / (len(times) - 1) * 1000)
            if span > 0:
                self.metric("tokens_per_s", (len(times) - 1) / span)

    @contextlib.contextmanager
    def killable(self, sequences: int) -> Iterator[None]:
        """Counts the request as dropped if the user is killed while it is in flight (a user
        still busy when --stop-timeout runs out): its connection is closed under it."""
        try:
            yield
        except gevent.GreenletExit:
            TALLY.drop(f"{self.kind} (stopped)", sequences)
            raise

    def post_json(self, path: str, body: dict[str, Any], name: str | None = None,
                  sequences: int = 1) -> dict[str, Any] | None:
        with self.killable(sequences), self.client.post(
                path, json=body, catch_response=True, name=name or path, timeout=60) as resp:
            if resp.status_code == 200:
                resp.success()
                return dict(resp.json())
            resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
            return None


def _tokens(obj: dict[str, Any]) -> int:
    if obj.get("type") == "response.output_text.delta":
        return 1
    count = 0
    for choice in obj.get("choices") or ():
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        count += 1 if text else 0
    return count
