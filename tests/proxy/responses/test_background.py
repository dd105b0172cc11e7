"""The Responses API's background responses against the scripted test daemon on real FIFOs
(`StorePeer`: tests/proxy/responses/test_routes.py): run to the end, cancelled, and a stream that
outlives its client."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from starlette.applications import Starlette

from ipc.records import AbortCause
from proxy.app import create_app
from proxy.options import ProxyOptions
from tests.proxy.responses.test_routes import StorePeer, app, client, oai, peer, tokens
from tests.support.live_proxy import LiveProxy
from tests.support.raw_http import sse_events
from tests.support.wait import wait_for, wait_until

__all__ = ["app", "client", "oai", "peer"]  # the fixtures these tests take


def test_background_runs_to_the_end_and_cannot_be_cancelled_after(oai: openai.OpenAI,
                                                                  peer: StorePeer) -> None:
    response = oai.responses.create(input="hi", max_output_tokens=3, background=True)
    assert response.status == "queued" and response.background
    wait_for(lambda: oai.responses.retrieve(response.id).status not in ("queued", "in_progress"),
             5, "the background response ends")
    got = oai.responses.retrieve(response.id)
    assert got.status == "incomplete" and got.output_text == tokens(3)
    with pytest.raises(openai.BadRequestError, match="incomplete"):
        oai.responses.cancel(response.id)
    assert peer.aborts == []


def test_cancel_a_background_response_ends_every_reader(oai: openai.OpenAI,
                                                        peer: StorePeer) -> None:
    peer.hold = True
    response = oai.responses.create(input="hi", max_output_tokens=100, background=True)
    assert oai.responses.retrieve(response.id).status == "queued"
    seen: list[list[str]] = [[], []]

    def read(i: int) -> None:
        with oai.responses.retrieve(response.id, stream=True) as stream:
            for event in stream:
                seen[i].append(event.type)

    readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in readers:
        t.start()
    peer.wait_for(lambda p: len(p.submits) == 1)
    wait_for(lambda: all(len(types) >= 2 for types in seen), 5, "both readers are reading")
    cancelled = oai.responses.cancel(response.id)
    assert cancelled.status == "cancelled"
    for t in readers:
        t.join(5)
        assert not t.is_alive()
    for types in seen:
        assert types[:2] == ["response.created", "response.queued"]
        assert types[-1] == "response.cancelled"
    assert [(a.rid, a.cause) for a in peer.aborts] == [(response.id, AbortCause.CANCEL)]
    assert oai.responses.retrieve(response.id).status == "cancelled"
    assert oai.responses.cancel(response.id).status == "cancelled"  # idempotent


def test_a_background_stream_survives_its_client(live: LiveProxy, oai: openai.OpenAI,
                                                 peer: StorePeer) -> None:
    body = {"input": "hi", "max_output_tokens": 20, "background": True, "stream": True}
    with httpx.stream("POST", live.url + "/v1/responses", json=body, timeout=5) as r:
        first = next(r.iter_lines())
    assert first == "event: response.created"
    peer.wait_for(lambda p: len(p.submits) >= 1)  # the background task submits on its own time
    rid = peer.submits[-1].rid
    peer.wait_for(lambda p: rid in p.finished)
    assert peer.aborts == []
    with oai.responses.retrieve(rid, stream=True, starting_after=2) as stream:
        events = list(stream)
    assert events[0].sequence_number == 3
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == tokens(20)


@pytest.mark.anyio
async def test_a_lost_daemon_interrupts_background_streams_without_an_ending(
        app: Starlette, client: httpx.AsyncClient, peer: StorePeer,
        options: ProxyOptions) -> None:
    """The daemon may well go on with a background response the proxy lost sight of: its readers
    are told the stream was interrupted, never that it failed, and the ending comes from the
    store once a daemon answers (here one that never heard of it: it failed)."""
    peer.hold = True
    created = (await client.post("/v1/responses", json={
        "input": "hi", "background": True})).json()
    await wait_until(lambda: len(peer.submits) == 1)
    run = app.state.background_responses.get(created["id"])
    peer.stop()
    await wait_until(lambda: run.interrupted)
    assert run.history[-1]["type"] == "error" and run.history[-1]["code"] == "stream_interrupted"
    assert not run.finished
    away = await client.get(f"/v1/responses/{created['id']}")
    assert away.status_code == 503  # the store is what knows, and it is away
    fresh = StorePeer(options.runtime_dir).start()
    try:
        await wait_until(lambda: run.finished, timeout=10)
        r = await client.get(f"/v1/responses/{created['id']}", params={"stream": "true"})
        types = [e["type"] for e in sse_events(r.content)]
        assert types[-2:] == ["error", "response.failed"], types
        assert types.count("error") == 1
        got = (await client.get(f"/v1/responses/{created['id']}")).json()
        assert got["status"] == "failed" and got["error"]["message"]
    finally:
        fresh.stop()


@pytest.mark.anyio
async def test_cancel_before_the_daemon_admits_it(app: Starlette, client: httpx.AsyncClient,
                                                  peer: StorePeer) -> None:
    """A cancel that overtakes the Submit (control and requests are separate pipes)."""
    peer.hold = True
    created = (await client.post("/v1/responses", json={
        "input": "hi", "background": True})).json()
    run = app.state.background_responses.get(created["id"])
    assert run is not None and not run.finished
    await wait_until(lambda: len(peer.submits) == 1)
    peer.unadmitted.add(created["id"])
    r = await client.post(f"/v1/responses/{created['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert run.history[-1]["type"] == "response.cancelled"
    got = (await client.get(f"/v1/responses/{created['id']}")).json()
    assert got["status"] == "cancelled"


@pytest.mark.anyio
async def test_shutdown_releases_background_responses_to_the_daemon(options: ProxyOptions,
                                                                    peer: StorePeer) -> None:
    """A stopping proxy neither waits for nor aborts a background response: the daemon goes on
    with it. Its readers get an error event that says so, and their stream ends."""
    peer.hold = True
    application = create_app(options)
    async with application.router.lifespan_context(application):
        await wait_until(lambda: application.state.engine.up)
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            created = (await c.post("/v1/responses", json={"input": "hi",
                                                           "background": True})).json()
        await wait_until(lambda: len(peer.submits) == 1)
        run = application.state.background_responses.get(created["id"])
        reader = run.subscribe()
        assert (await anext(reader))[0]["type"] == "response.created"
        assert application.state.engine.num_attached == 0
        read_all = asyncio.create_task(collect(reader))
    last = (await asyncio.wait_for(read_all, 5))[-1]
    assert last["type"] == "error" and last["code"] == "server_restarting"
    assert created["id"] in last["message"] and not run.finished
    await wait_until(lambda: bool(peer.goodbyes))  # the stopped proxy's last record
    assert peer.aborts == []


async def collect(batches: AsyncIterator[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [event async for batch in batches for event in batch]
