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

import os
import random
import time
from pathlib import Path
from typing import Any

import gevent
from locust import events, task
from locust.env import Environment
from locust.runners import WorkerRunner

from loadtest.locust_tally import TALLY, checks
from loadtest.locust_user import OpenAIUser
from loadtest.metrics import gauges, scrape, wait_settled
from loadtest.pair import served_model
from loadtest.report import write_json

DEFAULT_WEIGHTS = "stream_chat=4,chat=2,completions=2,conversation=1,background=1"
WORDS = ("tether", "stream", "token", "cache", "block", "abort", "pipe", "daemon", "proxy",
         "client", "session", "signal", "queue", "tick", "batch", "prompt")


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


def _words(n: int) -> str:
    return " ".join(random.choice(WORDS) for _ in range(n))


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
        opts.lt_model = served_model(environment.host) or "default"
    TALLY.baseline = scrape(environment.host)


@events.test_stop.add_listener
def _on_test_stop(environment: Environment, **_kw: Any) -> None:
    if TALLY.baseline is None or isinstance(environment.runner, WorkerRunner):
        return
    assert environment.host and environment.parsed_options
    base = gauges(TALLY.baseline)
    settled, now, waited = wait_settled(environment.host, base,
                                        environment.parsed_options.lt_settle)
    TALLY.settle = {"settled": settled, "baseline": base, "after": now, "waited_s": waited}


@events.quitting.add_listener
def _on_quitting(environment: Environment, **_kw: Any) -> None:
    if TALLY.baseline is None or isinstance(environment.runner, WorkerRunner):
        return
    assert environment.host and environment.parsed_options
    report, problems = checks(TALLY, scrape(environment.host))
    print("\n=== tether load test checks ===")
    for key, value in report.items():
        print(f"  {key:<34} {value}")
    for problem in problems:
        print(f"  FAIL: {problem}")
    print("  result:", "FAIL" if problems else "PASS")
    if environment.parsed_options.lt_out:
        write_json(Path(environment.parsed_options.lt_out) / "loadtest_checks.json",
                   {"figures": report, "problems": problems})
    if problems:
        environment.process_exit_code = 1
