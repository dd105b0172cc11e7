"""The access log: one line per request, with the reason a refused one was given."""

from __future__ import annotations

import dataclasses
import logging

import httpx
import pytest

from proxy.options import ProxyOptions
from tests.proxy.conftest import running_app
from tests.support.peer import Peer

pytestmark = pytest.mark.anyio


def lines(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [r.fields for r in caplog.records if r.name == "tether.access"]  # type: ignore[attr-defined]


async def call(options: ProxyOptions, *requests: tuple[str, str, dict | None]) -> list[int]:
    async with running_app(options) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            codes = [(await c.request(m, path, json=body,
                                      headers={"X-Request-Id": "client-7"})).status_code
                     for m, path, body in requests]
    return codes


async def test_a_refused_request_logs_its_status_route_and_reason(
        options: ProxyOptions, peer: Peer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "tether.access")
    codes = await call(options, ("POST", "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "hi"}], "n": 0}),
                       ("GET", "/v1/responses/resp_nope", None))
    assert codes == [400, 404]
    refused, missing = lines(caplog)
    assert refused["status"] == 400 and refused["route"] == "/v1/chat/completions"
    assert refused["param"] == "n" and refused["message"]
    assert refused["client_request_id"] == "client-7" and refused["duration_s"] >= 0
    assert missing["route"] == "/v1/responses/{response_id}" and missing["status"] == 404
    assert [r.levelno for r in caplog.records if r.name == "tether.access"] == [logging.INFO] * 2


async def test_successes_are_sampled_and_zero_turns_the_log_off(
        options: ProxyOptions, peer: Peer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "tether.access")
    ok = ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
    bad = ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert await call(options, ok, bad) == [200, 400]
    [success, refusal] = lines(caplog)
    assert success["status"] == 200 and success["request_id"].startswith("cmpl-")
    assert refusal["status"] == 400 and refusal["param"] == "max_tokens"
    caplog.clear()
    await call(dataclasses.replace(options, access_log_sample=1e-9), ok, bad)
    assert [line["status"] for line in lines(caplog)] == [400]  # errors are always written
    caplog.clear()
    await call(dataclasses.replace(options, access_log_sample=0.0), ok, bad)
    assert lines(caplog) == []

