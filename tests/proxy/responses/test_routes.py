"""The Responses API routes against the scripted test daemon on real FIFOs.

`StorePeer` extends the scripted peer with the daemon's real response store (in memory), so
GET / DELETE / cancel get the answers the daemon gives. It does not evict: what an Abort does to
the store (a foreground placeholder removed, a background one cancelled) is the daemon's rule,
proven on the real daemon in tests/e2e/test_abort_responses.py. The peer finishes every sequence with
``length`` after ``max_tokens`` tokens "tok0 tok1 ...", so responses end ``incomplete``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgspec
import openai
import orjson
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from starlette.applications import Starlette
from starlette.types import Message

from daemon.responses.store import ResponseStore
from ipc.records import AbortCause, Error, Finish, FinishReason, RequestKind, Submit
from ipc.response_records import ResponseOp
from ipc.wire import ToDaemon, ToProxy
from proxy.options import ProxyOptions
from tests.proxy.conftest import running_app
from tests.support.live_proxy import LiveProxy
from tests.support.peer import CACHED_TOKENS, MODEL, PROMPT_TOKENS, Peer
from tests.support.raw_http import sse_events
from tests.support.wait import wait_until

STREAM_EVENTS = TypeAdapter(ResponseStreamEvent)


class StorePeer(Peer):
    """The scripted peer plus the daemon's response store, answering ResponseOps."""

    store: ResponseStore

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unadmitted: set[str] = set()  # placeholders to drop, as if not admitted yet

    def _run(self) -> None:
        # SQLite connections belong to the thread that made them: the peer's, as in the daemon.
        self.store = ResponseStore(None, max_count=100, max_age_s=3600.0)
        super()._run()

    def _handle(self, record: ToDaemon) -> list[ToProxy]:
        if isinstance(record, ResponseOp):
            if record.subject in self.unadmitted:
                self.store.remove(record.subject)
            reply = self.store.handle_op(record, running=record.subject in self._sessions)
            return [reply]
        if isinstance(record, Submit) and record.kind is RequestKind.RESPONSE:
            try:
                self.store.begin(record)
            except ValueError as exc:
                return [Error(record.rid, str(exc), param="previous_response_id")]
        return super()._handle(record)

    def _step(self) -> list[ToProxy]:
        out = super()._step()
        for record in out:
            if isinstance(record, Finish) and record.reason is FinishReason.LENGTH:
                n = record.usage.completion_tokens
                text = "".join(f"tok{k} " for k in range(n))
                self.store.complete(record.rid, text, record.usage,
                                    incomplete_reason="max_output_tokens")
        return out


@pytest.fixture
def peer(options: ProxyOptions) -> Iterator[StorePeer]:
    p = StorePeer(options.runtime_dir)
    p.start()
    yield p
    p.stop()


@pytest.fixture
def oai(live: LiveProxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=10)


@pytest.fixture
async def app(options: ProxyOptions, peer: StorePeer) -> AsyncIterator[Starlette]:
    async with running_app(options) as application:
        yield application


@pytest.fixture
async def client(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
        yield c


def tokens(n: int) -> str:
    return "".join(f"tok{k} " for k in range(n))


# --- foreground -----------------------------------------------------------------------------


def test_create_with_the_openai_client(oai: openai.OpenAI, peer: StorePeer) -> None:
    response = oai.responses.create(model=MODEL, input="hi", instructions="be brief",
                                    max_output_tokens=3, temperature=0.5)
    assert response.id.startswith("resp_")
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == tokens(3)
    assert response.usage is not None and response.usage.input_tokens == PROMPT_TOKENS
    assert response.usage.input_tokens_details.cached_tokens == CACHED_TOKENS
    submit = peer.submits[-1]
    assert submit.rid == response.id and submit.kind is RequestKind.RESPONSE
    assert submit.messages == [] and submit.n == 1
    assert submit.sampling.max_tokens == 3 and submit.sampling.temperature == 0.5
    assert submit.response is not None and submit.response.instructions == "be brief"
    assert msgspec.json.decode(submit.response.input_items) == [
        {"type": "message", "role": "user", "content": "hi"}]
    assert [(m.role, m.content) for m in submit.response.input] == [("user", "hi")]
    stored = oai.responses.retrieve(response.id)
    assert stored.status == "incomplete" and stored.output_text == tokens(3)


def test_previous_response_id_and_extensions_reach_the_daemon(oai: openai.OpenAI,
                                                              peer: StorePeer) -> None:
    first = oai.responses.create(input="hi", max_output_tokens=2)
    second = oai.responses.create(
        input=[{"role": "user", "content": [{"type": "input_text", "text": "more"}]}],
        previous_response_id=first.id, max_output_tokens=4,
        extra_body={"ignore_eos": True, "min_tokens": 2})
    assert second.previous_response_id == first.id
    submit = peer.submits[-1]
    assert submit.response is not None and submit.response.previous_response_id == first.id
    assert submit.sampling.ignore_eos and submit.sampling.min_tokens == 2


def test_stream_with_the_openai_client(oai: openai.OpenAI) -> None:
    with oai.responses.create(input="hi", max_output_tokens=2, stream=True) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
        == tokens(2)
    for event in events:
        assert type(event).__name__ != "BaseModel"
        STREAM_EVENTS.validate_python(event.model_dump())


def test_store_false_is_not_retrievable(oai: openai.OpenAI) -> None:
    response = oai.responses.create(input="hi", max_output_tokens=1, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(response.id)


def test_input_items_list_with_the_openai_client(oai: openai.OpenAI) -> None:
    items = [{"role": "system", "content": "be brief"},
             {"type": "message", "role": "user", "id": "msg_mine",
              "content": [{"type": "input_text", "text": "one"}]},
             {"role": "assistant", "content": "ONE"},
             {"role": "user", "content": "two"}]
    response = oai.responses.create(input=items, max_output_tokens=1)  # type: ignore[arg-type]
    page = oai.responses.input_items.list(response.id, order="asc")
    assert [item.role for item in page.data] == ["system", "user", "assistant", "user"]  # type: ignore[union-attr]
    assert page.data[1].id == "msg_mine" and page.data[0].id != page.data[2].id
    assert page.data[2].content[0].type == "output_text"  # type: ignore[union-attr]
    assert page.data[3].content[0].text == "two"  # type: ignore[union-attr]
    newest = oai.responses.input_items.list(response.id, limit=2)
    assert [i.id for i in newest.data] == [page.data[3].id, page.data[2].id]
    assert newest.has_more and newest.last_id == page.data[2].id
    rest = oai.responses.input_items.list(response.id, limit=2, after=newest.last_id)
    assert [i.id for i in rest.data] == [page.data[1].id, page.data[0].id] and not rest.has_more
    first = oai.responses.create(input="just text", max_output_tokens=1)
    [only] = oai.responses.input_items.list(first.id).data
    assert only.content[0].text == "just text"  # type: ignore[union-attr]


@pytest.mark.anyio
@pytest.mark.parametrize(("query", "param"), [("limit=0", "limit"), ("limit=101", "limit"),
                                               ("limit=x", "limit"), ("order=up", "order"),
                                               ("after=msg_none", "after")])
async def test_input_items_bad_query_is_400(client: httpx.AsyncClient, query: str,
                                            param: str) -> None:
    created = (await client.post("/v1/responses", json={"input": "hi",
                                                        "max_output_tokens": 1})).json()
    r = await client.get(f"/v1/responses/{created['id']}/input_items?{query}")
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# --- validation -----------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "background": True, "store": False}, "background"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "top_p": 0}, "top_p"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     "input[0].content[0].type"),
    ({"input": []}, "input"),
    ({"model": MODEL}, "input"),
    ({"input": "hi", "stream": "yes"}, "stream"),
])
async def test_invalid_bodies_name_the_field(client: httpx.AsyncClient, peer: StorePeer,
                                             body: dict[str, Any], param: str) -> None:
    r = await client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert peer.submits == []


@pytest.mark.anyio
async def test_metadata_and_user_are_tolerated(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/responses", json={
        "input": "hi", "max_output_tokens": 1, "user": "u1", "metadata": {"k": "v"},
        "model": MODEL})
    assert r.status_code == 200 and r.json()["status"] == "incomplete"


@pytest.mark.anyio
async def test_unknown_ids_are_404(client: httpx.AsyncClient) -> None:
    for method, path in (("GET", "/v1/responses/resp_nope"),
                         ("DELETE", "/v1/responses/resp_nope"),
                         ("POST", "/v1/responses/resp_nope/cancel"),
                         ("GET", "/v1/responses/resp_nope/input_items")):
        r = await client.request(method, path)
        assert r.status_code == 404, (method, r.text)
        assert r.json()["error"]["code"] == "not_found"


@pytest.mark.anyio
async def test_delete_then_get_is_404(client: httpx.AsyncClient) -> None:
    created = (await client.post("/v1/responses", json={"input": "hi",
                                                        "max_output_tokens": 1})).json()
    r = await client.delete(f"/v1/responses/{created['id']}")
    assert r.json() == {"id": created["id"], "object": "response.deleted", "deleted": True}
    assert (await client.get(f"/v1/responses/{created['id']}")).status_code == 404


@pytest.mark.anyio
async def test_the_response_id_is_the_servers_own(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1},
                          headers={"X-Request-Id": "resp_mine"})
    assert r.headers["x-request-id"] == "resp_mine"
    assert r.json()["id"].startswith("resp_") and r.json()["id"] != "resp_mine"


# --- foreground disconnects -----------------------------------------------------------------


async def call_until_disconnect(app: Starlette, body: dict[str, Any],
                                disconnect: asyncio.Event) -> list[Message]:
    """POST /v1/responses by hand; the client leaves when `disconnect` is set."""
    sent: list[Message] = []
    payload = orjson.dumps(body)
    messages: list[Message] = [{"type": "http.request", "body": payload, "more_body": False}]

    async def receive() -> Message:
        if messages:
            return messages.pop(0)
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": "/v1/responses",
             "raw_path": b"/v1/responses", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(payload)).encode())],
             "client": ("127.0.0.1", 1), "server": ("proxy", 80)}
    await app(scope, receive, send)
    return sent


@pytest.mark.anyio
async def test_a_foreground_disconnect_writes_an_abort(app: Starlette, peer: StorePeer) -> None:
    peer.hold = True
    disconnect = asyncio.Event()
    call = asyncio.ensure_future(call_until_disconnect(
        app, {"input": "hi", "max_output_tokens": 50}, disconnect))
    await wait_until(lambda: len(peer.submits) == 1)
    disconnect.set()
    await call
    rid = peer.submits[0].rid
    await wait_until(lambda: any(a.rid == rid for a in peer.aborts))
    assert [a.cause for a in peer.aborts] == [AbortCause.CLIENT_DISCONNECT]


@pytest.mark.anyio
async def test_a_foreground_stream_disconnect_writes_an_abort(app: Starlette,
                                                              peer: StorePeer) -> None:
    disconnect = asyncio.Event()
    call = asyncio.ensure_future(call_until_disconnect(
        app, {"input": "hi", "max_output_tokens": 2000, "stream": True}, disconnect))
    await wait_until(lambda: len(peer.submits) == 1)
    rid = peer.submits[0].rid
    await wait_until(lambda: peer.produced(rid) >= 2)  # streaming by now
    disconnect.set()
    sent = await call
    assert sent[0]["status"] == 200
    await wait_until(lambda: any(a.rid == rid for a in peer.aborts))
    assert peer.aborts[0].cause is AbortCause.CLIENT_DISCONNECT
    assert rid not in peer.finished


def test_a_foreground_stream_that_loses_the_daemon_ends_failed(live: LiveProxy,
                                                               peer: StorePeer) -> None:
    """Headers and some text are out when the daemon goes: the stream ends with an error event
    and `response.failed`, in sequence."""
    body = {"input": "hi", "max_output_tokens": 2000, "stream": True}
    with httpx.stream("POST", live.url + "/v1/responses", json=body, timeout=10) as r:
        assert r.status_code == 200
        chunks = r.iter_bytes()
        raw = next(chunks)
        peer.wait_for(lambda p: bool(p.submits) and p.produced(p.submits[0].rid) >= 2)
        peer.stop()
        raw += b"".join(chunks)
    events = sse_events(raw)
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in types
    assert types[-2:] == ["error", "response.failed"], types[-4:]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "daemon" in events[-1]["response"]["error"]["message"]
