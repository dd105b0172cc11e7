from __future__ import annotations

import httpx
import pytest
from starlette.types import Message, Receive, Scope, Send

from proxy.http.auth import ApiKeyMiddleware

pytestmark = pytest.mark.anyio

KEYS = ["sk-one", "sk-two"]


async def inner(scope: Scope, receive: Receive, send: Send) -> None:
    # Answers with what receive() delivered, to show the middleware hands it through untouched.
    message = await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": message["type"].encode()})


def client(keys: list[str]) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=ApiKeyMiddleware(inner, keys))
    return httpx.AsyncClient(transport=transport, base_url="http://p")


async def test_missing_or_wrong_key_is_401() -> None:
    async with client(KEYS) as c:
        for headers in ({}, {"Authorization": "Bearer sk-nope"}, {"Authorization": "sk-one"},
                        {"Authorization": "Basic sk-one"}, {"Authorization": "Bearer "}):
            r = await c.post("/v1/completions", headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"


async def test_any_configured_key_passes_and_receive_is_intact() -> None:
    async with client(KEYS) as c:
        for key in KEYS:
            r = await c.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"})
            assert (r.status_code, r.text) == (200, "http.request")


async def test_health_and_metrics_stay_open() -> None:
    async with client(KEYS) as c:
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200


async def test_no_keys_means_no_auth() -> None:
    async with client([]) as c:
        assert (await c.post("/v1/completions")).status_code == 200


async def test_401_without_reading_the_body() -> None:
    received: list[Message] = []

    async def receive() -> Message:
        received.append({"type": "http.request"})
        return {"type": "http.request", "body": b"x" * 10, "more_body": False}

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/responses", "headers": []}
    await ApiKeyMiddleware(inner, KEYS)(scope, receive, send)
    assert sent[0]["status"] == 401 and not received
