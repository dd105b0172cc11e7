"""The server under test, as the abort benchmark sees it: the metric names of its family
(tether, vLLM, SGLang), the request it sends, and a stream reader that counts tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import orjson

from loadtest import metrics, sse_client

PROMPT = "The quick brown fox jumps over the lazy dog and keeps running because"

# Counter / gauge names per server family, so the bench also runs against peers.
FAMILIES: dict[str, dict[str, str]] = {
    "tether": {"gen": "tether_generation_tokens_total", "prompt": "tether_prompt_tokens_total",
               "running": "tether_requests_running", "waiting": "tether_requests_waiting",
               "after": "tether_tokens_after_disconnect_total",
               "latency": "tether_abort_latency_seconds",
               "ticks": "tether_abort_latency_ticks"},
    "vllm": {"gen": "vllm:generation_tokens_total", "prompt": "vllm:prompt_tokens_total",
             "running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting"},
    "sglang": {"gen": "sglang:generation_tokens_total", "prompt": "sglang:prompt_tokens_total",
               "running": "sglang:num_running_reqs", "waiting": "sglang:num_queue_reqs"},
}

class Server:
    """The server under test and the metric names it exposes (None: no usable /metrics)."""

    def __init__(self, base_url: str, model: str) -> None:
        self.base = base_url
        self.model = model
        self.names: dict[str, str] = {}
        self.exact = False  # the server sends token_ids with each chunk
        try:
            m = metrics.scrape(base_url)
        except OSError:
            return
        for names in FAMILIES.values():
            if m.has(names["gen"]):
                self.names = names
                return

    def scrape(self) -> metrics.Metrics | None:
        return metrics.scrape(self.base) if self.names else None

    def value(self, m: metrics.Metrics | None, key: str) -> float | None:
        if m is None or key not in self.names:
            return None
        return m.total(self.names[key])

    def busy(self) -> float | None:
        m = self.scrape()
        if m is None:
            return None
        return (self.value(m, "running") or 0.0) + (self.value(m, "waiting") or 0.0)

    async def wait_idle(self, within: float = 30.0) -> float | None:
        """Monotonic time at which running + waiting first read 0 (None without metrics)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            busy = self.busy()
            if busy is None:
                return None
            if busy <= 0:
                return time.monotonic()
            await asyncio.sleep(0.002)
        raise TimeoutError(f"server still busy after {within} s")

    async def wait_for(self, key: str, at_least: float, within: float = 10.0) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if (self.value(self.scrape(), key) or 0.0) >= at_least:
                return True
            await asyncio.sleep(0.01)
        return False

    def body(self, max_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": PROMPT, "max_tokens": max_tokens,
                                "ignore_eos": True, "stream": stream, "return_token_ids": True}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return {**body, **extra}


@dataclasses.dataclass(slots=True)
class Tally:
    """Tokens delivered so far, over every client stream, counted as they arrive."""

    tokens: int = 0


def delta(srv: Server, before: metrics.Metrics | None, after: metrics.Metrics | None,
          key: str) -> float | None:
    a, b = srv.value(after, key), srv.value(before, key)
    return None if a is None or b is None else a - b


def _has_token_ids(obj: dict[str, Any]) -> bool:
    return any(isinstance(c.get("token_ids"), list) for c in obj.get("choices") or ())


async def read_stream(resp: sse_client.Response, stop_after: int | None,
                      times: list[float] | None = None,
                      srv: Server | None = None,
                      tally: Tally | None = None) -> tuple[int, int | None]:
    """Reads until the end or `stop_after` tokens: (tokens received, usage tokens if ended).

    Given `srv`, records there whether the server sends token_ids (exact counts); given
    `tally`, adds each event's tokens to it as they arrive."""
    got = 0
    async for data in resp.events():
        if data == b"[DONE]":
            break
        obj = orjson.loads(data)
        if obj.get("usage") and not obj.get("choices"):
            return got, int(obj["usage"]["completion_tokens"])
        n = sse_client.tokens_in_event(obj)
        if srv is not None and not srv.exact:
            srv.exact = _has_token_ids(obj)
        got += n
        if tally is not None:
            tally.tokens += n
        if times is not None and n:
            times.append(time.monotonic())
        if stop_after is not None and got >= stop_after:
            break
    return got, None
