"""Edge cases of the assembled app: routing errors, limits, health, models, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import anyio
import httpx
import pytest
from starlette.types import Message

from proxy.app import create_app
from proxy.options import ProxyOptions
from tests.support.metrics import parse_metrics
from tests.support.peer import MODEL, Peer
from tests.support.wait import wait_until

pytestmark = pytest.mark.anyio


async def call(app: Any, method: str, path: str, chunks: list[bytes],
               headers: list[tuple[bytes, bytes]] | None = None) -> tuple[int, dict[str, str],
                                                                          bytes]:
    """Drives the ASGI app by hand: the body arrives in `chunks`, with no Content-Length."""
    pending = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
               for i, c in enumerate(chunks)]
    sent: list[Message] = []
    complete = asyncio.Event()

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        await complete.wait()  # as a server does: the client stays until the answer is sent
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            complete.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": method, "path": path, "raw_path": path.encode(),
             "query_string": b"", "headers": headers or [], "scheme": "http",
             "server": ("test", 80), "client": ("test", 1), "root_path": ""}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    head = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], head, body


async def test_unknown_route_and_wrong_method_are_openai_errors(
        client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = await client.get("/v1/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    assert r.json()["error"]["type"] == "invalid_request_error"


async def test_bad_input_is_400_naming_the_field(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": -5})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "max_tokens" and ">= 1" in error["message"]
    r = await client.post("/v1/chat/completions", json={"messages": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = await client.post("/v1/completions", json={"prompt": "x"},
                          headers={"X-Request-Id": "bad id!"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"


async def test_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json={
        "model": "gpt-5", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_body_over_the_limit_is_413(options: ProxyOptions, peer: Peer) -> None:
    options = dataclasses.replace(options, max_body_bytes=100)
    app = create_app(options)
    async with app.router.lifespan_context(app):
        await wait_until(lambda: app.state.engine.up)
        big = b'{"prompt": "' + b"x" * 200 + b'"}'
        status, _, body = await call(app, "POST", "/v1/completions", [big],
                                     [(b"content-length", str(len(big)).encode())])
        assert status == 413 and b"100 bytes" in body
        # Chunked: no Content-Length, so the limit is enforced while counting.
        status, _, _ = await call(app, "POST", "/v1/completions", [big[:60], big[60:]])
        assert status == 413
        status, _, _ = await call(app, "POST", "/v1/completions", [b'{"prompt": "x", ',
                                                                   b'"max_tokens": 1}'])
        assert status == 200
        status, _, _ = await call(app, "POST", "/v1/completions", [b"{}"],
                                  [(b"content-length", b"abc")])
        assert status == 400


async def test_health_models_and_metrics(client: httpx.AsyncClient, peer: Peer) -> None:
    r = await client.get("/health")
    assert r.status_code == 200 and r.json()["model"] == MODEL
    r = await client.get("/v1/models")
    assert [m["id"] for m in r.json()["data"]] == [MODEL]
    await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    await wait_until(lambda: bool(peer.finished))
    for _ in range(100):  # the daemon's gauges show once its first Stats has come
        r = await client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        figures = parse_metrics(r.text)
        if "tether_kv_cache_blocks_total" in figures:
            break
        await anyio.sleep(0.02)
    assert figures["tether_kv_cache_blocks_total"] == 64
    assert figures['tether_aborts_total{cause="client_disconnect"}'] == 0
    assert figures['tether_ipc_bad_records_total{pipe="tokens"}'] == 0
    assert figures["tether_time_to_first_token_seconds_count"] >= 1
    assert figures['tether_request_duration_seconds_count{endpoint="completions"}'] >= 1
    assert figures["tether_daemon_up"] == 1


async def test_daemon_down_is_503_everywhere_but_metrics(options: ProxyOptions) -> None:
    app = create_app(options)  # no daemon peer at all
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://p") as c:
            r = await c.get("/health")
            assert r.status_code == 503 and r.json()["reason"]
            r = await c.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 503
            assert r.json()["error"]["type"] == "service_unavailable"
            assert (await c.get("/metrics")).status_code == 200
            assert (await c.get("/v1/models")).status_code == 200


async def test_two_apps_have_separate_registries(options: ProxyOptions, peer: Peer) -> None:
    first, second = create_app(options), create_app(options)
    async with first.router.lifespan_context(first), second.router.lifespan_context(second):
        assert first.state.metrics.registry is not second.state.metrics.registry
