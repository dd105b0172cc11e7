"""100 concurrent streams, half dropped at random points: survivors complete, nothing leaks."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.support.metrics import m
from tests.support.pair import BASELINE_GAUGES, Server, assert_baseline, start_server
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 24
STREAMS = 100


@pytest.fixture(scope="module")
def big_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("churn"), ["--max-num-seqs", "64"])
    yield s
    s.stop()


async def one_stream(client: httpx.AsyncClient, i: int, drop_after: int | None) -> dict[str, object]:
    body = {"prompt": f"stream number {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    chunks, text, usage, finish, tokens = 0, "", None, None, 0
    headers = {"X-Request-Id": f"churn-{i}"}
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                chunks += 1
                text += choice.get("text") or ""
                tokens += len(choice.get("token_ids") or ())
                finish = choice.get("finish_reason") or finish
            if drop_after is not None and chunks >= drop_after:
                break  # leaving the context closes the connection mid-stream
    return {"dropped": drop_after is not None, "usage": usage, "finish": finish, "text": text,
            "tokens": tokens}


async def churn(server: Server) -> list[dict[str, object]]:
    rng = random.Random(7)
    drops: list[int | None] = [rng.randint(1, 20) for _ in range(STREAMS // 2)]
    drops += [None] * (STREAMS - len(drops))
    rng.shuffle(drops)
    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120,
                                 limits=limits) as client:
        return await asyncio.gather(*(one_stream(client, i, d) for i, d in enumerate(drops)))


def test_churn_survivors_complete_and_nothing_leaks(big_server: Server) -> None:
    before = big_server.metrics()
    results = asyncio.run(churn(big_server))
    survivors = [r for r in results if not r["dropped"]]
    for r in survivors:
        assert r["finish"] == "length"
        assert r["tokens"] == MAX_TOKENS  # the chunks carry exactly what usage reports
        usage: dict[str, Any] = r["usage"]  # type: ignore[assignment]
        prompt = usage["prompt_tokens"]
        assert usage == {"prompt_tokens": prompt, "completion_tokens": MAX_TOKENS,
                         "total_tokens": prompt + MAX_TOKENS,
                         "prompt_tokens_details": usage["prompt_tokens_details"]}
        assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < prompt
    dropped = STREAMS - len(survivors)
    # A stream dropped after its last token was generated finished normally; the rest were aborted.
    wait_for(lambda: all(m(big_server.metrics(), g) == 0 for g in BASELINE_GAUGES), 30,
             "the engine to go idle")
    after = big_server.metrics()
    assert_baseline(after)
    aborted = m(after, "tether_aborts_total", cause="client_disconnect") - m(
        before, "tether_aborts_total", cause="client_disconnect")
    assert 0 < aborted <= dropped
    # Per request, not summed: each aborted stream got at most one token after the proxy saw it go.
    lines = [x for x in big_server.log_lines("daemon") if x["logger"] == "tether.requests"
             and (x.get("client_id") or "").startswith("churn-")
             and x["cause"] == "client_disconnect"]
    assert len(lines) == aborted
    for line in lines:
        assert line["ticks_after_disconnect"] <= 1 and line["tokens_after_disconnect"] <= 1, line
    assert sum(x["tokens_after_disconnect"] for x in lines) == (
        m(after, "tether_tokens_after_disconnect_total")
        - m(before, "tether_tokens_after_disconnect_total"))
