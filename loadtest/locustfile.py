"""Locust load test for tether: OpenAI-style clients, a share of whom leave early.

User kinds (relative weights via --lt-weights / LT_WEIGHTS):

- stream_chat   streaming chat, reads the SSE stream; dropping ones close it after a random
                number of tokens or a random time
- chat          non-streaming chat; dropping ones use a short client timeout
- completions   a list of prompts with n > 1 (len(prompts) * n sequences); dropping ones stream
                and close early
- conversation  Responses API turns chained through previous_response_id; a dropping turn
                streams and closes early, ending the conversation
- background    background responses that are cancelled shortly after creation

Options (flag, env, default): --lt-churn LT_CHURN 0.3 (share of requests that leave early),
--lt-max-tokens LT_MAX_TOKENS 48, --lt-model LT_MODEL (default: first of /v1/models), --lt-weights LT_WEIGHTS,
--lt-settle LT_SETTLE_S 2.0, --lt-out LT_OUT (directory for loadtest_checks.json).

When the run stops, the quitting listener fails it (exit code 1) if within --lt-settle seconds
the running / waiting / KV-block / placeholder gauges are not back to their pre-run values, if
any 5xx was answered, or if tokens generated after a disconnect exceed one per dropped
sequence (dropped sequences are counted here, client-side). Run it alone (not distributed):
the tallies live in this process.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import common
import gevent
from locust import HttpUser, between, events, task
from locust.env import Environment
from locust.runners import WorkerRunner
from lt_tally import Tally, checks

DEFAULT_WEIGHTS = "stream_chat=4,chat=2,completions=2,conversation=1,background=1"
TERMINAL_RESPONSE_EVENTS = ("response.completed", "response.incomplete", "response.cancelled",
                            "response.failed")
WORDS = ("tether", "stream", "token", "cache", "block", "abort", "pipe", "daemon", "proxy",
         "client", "session", "signal", "queue", "tick", "batch", "prompt")


TALLY = Tally()


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    env = os.environ.get
    parser.add_argument("--lt-churn", type=float, default=float(env("LT_CHURN", "0.3")),
                        help="share of requests whose client leaves early")
    parser.add_argument("--lt-max-tokens", type=int, default=int(env("LT_MAX_TOKENS", "48")),
                        help="max_tokens of a request that runs to the end")
    parser.add_argument("--lt-model", default=env("LT_MODEL", ""),
                        help="model name sent in requests (default: the first of /v1/models)")
    parser.add_argument("--lt-weights", default=env("LT_WEIGHTS", DEFAULT_WEIGHTS),
                        help="kind=weight,... over stream_chat chat completions conversation "
                             "background")
    parser.add_argument("--lt-settle", type=float, default=float(env("LT_SETTLE_S", "2.0")),
                        help="seconds the gauges get to return to baseline after load stops")
    parser.add_argument("--lt-out", default=env("LT_OUT", ""),
                        help="directory for loadtest_checks.json")


def _opt(user: HttpUser, name: str) -> Any:
    return getattr(user.environment.parsed_options, name)


def _words(n: int) -> str:
    return " ".join(random.choice(WORDS) for _ in range(n))


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


class StreamChatUser(OpenAIUser):
    kind = "stream_chat"

    @task
    def chat_stream(self) -> None:
        drop = self.plan()
        body = {"model": self.model, "messages": [{"role": "user", "content": _words(8)}],
                "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": self.max_tokens, "ignore_eos": True}
        if self.stream("/v1/chat/completions", body, drop, 1, self.max_tokens) is not None:
            TALLY.completed[self.kind] += 1


class ChatUser(OpenAIUser):
    kind = "chat"

    @task
    def chat(self) -> None:
        drop = self.plan()
        tokens = self.max_tokens * (8 if drop else 1)
        timeout = random.uniform(0.05, 0.4) if drop else 60.0
        body = {"model": self.model, "messages": [{"role": "user", "content": _words(8)}],
                "max_tokens": tokens, "ignore_eos": True}
        start = time.perf_counter()
        with self.killable(1), self.client.post("/v1/chat/completions", json=body,
                                                catch_response=True, timeout=timeout) as resp:
            if resp.status_code == 0 and drop:
                # The client timeout fired: an expected departure, not a failure.
                resp.success()
                TALLY.drop(self.kind, 1)
                self.metric("disconnect", (time.perf_counter() - start) * 1000)
                return
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            usage = resp.json().get("usage") or {}
            if usage.get("completion_tokens") != tokens:
                resp.failure(f"completion_tokens {usage.get('completion_tokens')} != {tokens}")
                return
            resp.success()
            TALLY.completed[self.kind] += 1


class CompletionsUser(OpenAIUser):
    kind = "completions"

    @task
    def completions(self) -> None:
        drop = self.plan()
        prompts = [_words(random.randint(2, 12)) for _ in range(random.randint(1, 3))]
        n = random.randint(2, 3)
        body = {"model": self.model, "prompt": prompts, "n": n, "max_tokens": self.max_tokens,
                "ignore_eos": True}
        if drop:
            body["stream"] = True
            self.stream("/v1/completions", body, drop, len(prompts) * n, None)
            return
        out = self.post_json("/v1/completions", body, sequences=len(prompts) * n)
        if out is None:
            return
        indexes = sorted(c.get("index") for c in out.get("choices", []))
        if indexes != list(range(len(prompts) * n)):
            self.metric("bad_choices", 1)
            events.request.fire(request_type="CHECK", name="completions choices",
                                response_time=0, response_length=0, context={},
                                exception=AssertionError(f"choice indexes {indexes}"))
            return
        TALLY.completed[self.kind] += 1


class ConversationUser(OpenAIUser):
    kind = "conversation"

    @task
    def conversation(self) -> None:
        previous: str | None = None
        ids: list[str] = []
        for _turn in range(random.randint(2, 4)):
            drop = self.plan()
            body: dict[str, Any] = {"model": self.model, "input": _words(6), "store": True,
                                    "max_output_tokens": self.max_tokens, "ignore_eos": True}
            if previous:
                body["previous_response_id"] = previous
            if drop:
                body["stream"] = True
                self.stream("/v1/responses", body, drop, 1, None)
                break
            out = self.post_json("/v1/responses", body)
            if out is None or out.get("status") not in ("completed", "incomplete"):
                return
            previous = out["id"]
            ids.append(previous)
        else:
            TALLY.completed[self.kind] += 1
        for rid in ids:
            self.client.delete(f"/v1/responses/{rid}", name="/v1/responses/{id} delete")


class BackgroundUser(OpenAIUser):
    kind = "background"

    @task
    def background(self) -> None:
        body = {"model": self.model, "input": _words(6), "background": True, "store": True,
                "max_output_tokens": self.max_tokens * 8, "ignore_eos": True}
        out = self.post_json("/v1/responses", body, name="/v1/responses background")
        if out is None:
            return
        rid = out["id"]
        gevent.sleep(random.uniform(0.0, 0.3))
        with self.client.post(f"/v1/responses/{rid}/cancel", catch_response=True,
                              name="/v1/responses/{id}/cancel") as resp:
            if resp.status_code == 200:
                resp.success()
                TALLY.drop(self.kind, 1)
            elif resp.status_code == 400:
                resp.success()  # finished before the cancel arrived
                TALLY.completed[self.kind] += 1
            else:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
        self.await_terminal(rid)
        self.client.delete(f"/v1/responses/{rid}", name="/v1/responses/{id} delete")

    def await_terminal(self, rid: str) -> None:
        deadline = time.monotonic() + 5.0
        status = None
        while time.monotonic() < deadline:
            got = self.client.get(f"/v1/responses/{rid}", name="/v1/responses/{id}")
            status = got.json().get("status") if got.status_code == 200 else None
            if status in ("cancelled", "completed", "incomplete", "failed"):
                return
            gevent.sleep(0.05)
        events.request.fire(request_type="CHECK", name="background terminal", response_time=0,
                            response_length=0, context={},
                            exception=AssertionError(f"{rid} still {status} after 5 s"))


USER_CLASSES = {"stream_chat": StreamChatUser, "chat": ChatUser, "completions": CompletionsUser,
                "conversation": ConversationUser, "background": BackgroundUser}


@events.init.add_listener
def _on_init(environment: Environment, **_kw: Any) -> None:
    opts = environment.parsed_options
    if opts is None:
        return
    for item in filter(None, opts.lt_weights.split(",")):
        kind, _, weight = item.partition("=")
        if kind.strip() not in USER_CLASSES:
            raise SystemExit(f"--lt-weights: unknown kind {kind!r} (have {sorted(USER_CLASSES)})")
        USER_CLASSES[kind.strip()].weight = int(weight)


@events.request.add_listener
def _on_request(response: Any = None, **_kw: Any) -> None:
    if response is not None and getattr(response, "status_code", 0) >= 500:
        TALLY.status_5xx += 1


@events.test_start.add_listener
def _on_test_start(environment: Environment, **_kw: Any) -> None:
    if isinstance(environment.runner, WorkerRunner) or not environment.host:
        return
    opts = environment.parsed_options
    if opts is not None and not opts.lt_model:
        opts.lt_model = common.served_model(environment.host) or "default"
    TALLY.baseline = common.scrape(environment.host)


@events.test_stop.add_listener
def _on_test_stop(environment: Environment, **_kw: Any) -> None:
    if TALLY.baseline is None or isinstance(environment.runner, WorkerRunner):
        return
    assert environment.host and environment.parsed_options
    base = common.gauges(TALLY.baseline)
    settled, now, waited = common.wait_settled(environment.host, base,
                                               environment.parsed_options.lt_settle)
    TALLY.settle = {"settled": settled, "baseline": base, "after": now, "waited_s": waited}


@events.quitting.add_listener
def _on_quitting(environment: Environment, **_kw: Any) -> None:
    if TALLY.baseline is None or isinstance(environment.runner, WorkerRunner):
        return
    assert environment.host and environment.parsed_options
    report, problems = checks(TALLY, common.scrape(environment.host))
    print("\n=== tether load test checks ===")
    for key, value in report.items():
        print(f"  {key:<34} {value}")
    for problem in problems:
        print(f"  FAIL: {problem}")
    print("  result:", "FAIL" if problems else "PASS")
    if environment.parsed_options.lt_out:
        common.write_json(Path(environment.parsed_options.lt_out) / "loadtest_checks.json",
                          {"figures": report, "problems": problems})
    if problems:
        environment.process_exit_code = 1
