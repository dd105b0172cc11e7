"""CORS, off by default: preflights answered for the allowed origins only."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from proxy.options import CorsOptions, ProxyOptions
from tests.proxy.conftest import running_app
from tests.support.peer import Peer

pytestmark = pytest.mark.anyio

ORIGIN = "https://app.example"
PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


async def requests(options: ProxyOptions, origin: str) -> tuple[httpx.Response, httpx.Response]:
    async with running_app(options) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            preflight = await c.options("/v1/completions", headers={"Origin": origin, **PREFLIGHT})
            actual = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                  headers={"Origin": origin})
    return preflight, actual


def with_cors(options: ProxyOptions) -> ProxyOptions:
    return dataclasses.replace(options, api_keys=("sk-1",), cors=CorsOptions(
        (ORIGIN,), ("GET", "POST", "OPTIONS"), ("Authorization", "Content-Type")))


async def test_an_allowed_origin_gets_its_preflight_before_any_key_is_asked(
        options: ProxyOptions, peer: Peer) -> None:
    preflight, actual = await requests(with_cors(options), ORIGIN)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    # No key sent: refused, and the browser may read why.
    assert actual.status_code == 401 and actual.headers["access-control-allow-origin"] == ORIGIN


async def test_another_origin_is_refused_its_preflight(options: ProxyOptions, peer: Peer) -> None:
    preflight, actual = await requests(with_cors(options), "https://evil.example")
    assert preflight.status_code == 400
    assert "access-control-allow-origin" not in preflight.headers
    assert "access-control-allow-origin" not in actual.headers


async def test_cors_is_off_by_default(options: ProxyOptions, peer: Peer) -> None:
    preflight, actual = await requests(options, ORIGIN)
    assert "access-control-allow-origin" not in preflight.headers
    assert actual.status_code == 200 and "access-control-allow-origin" not in actual.headers
