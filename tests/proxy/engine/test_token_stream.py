"""Token streams written from the tokens callback, driven by hand through the ASGI app: a client
that keeps up gets exactly the bytes of one event per record; one that falls behind gets the
same bytes in fewer writes (or, with --stream-merge-tokens, the same tokens in fewer events);
leaving while a write waits still aborts at once, and flow control still sees what is held."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from starlette.applications import Starlette
from starlette.types import Message

from ipc.records import AbortCause, Pause, Resume
from proxy.options import ProxyOptions
from tests.proxy.conftest import running_app
from tests.support.peer import CACHED_TOKENS, MODEL, PROMPT_TOKENS, Peer
from tests.support.wait import wait_until

pytestmark = pytest.mark.anyio


class Client:
    """One request through the app; its writes block while `reading` is clear (a client that
    does not read: the send waits, as uvicorn's does once the socket is full)."""

    def __init__(self, app: Starlette, path: str, body: dict[str, Any]) -> None:
        self.reading = asyncio.Event()
        self.reading.set()
        self.gone = asyncio.Event()
        self.writes: list[bytes] = []  # body messages, as sent
        self.waiting = False  # a write is blocked on the client
        self.ended = False
        data = orjson.dumps(body)
        self._request: Message | None = {"type": "http.request", "body": data,
                                         "more_body": False}
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": "1.1", "method": "POST", "path": path,
                 "raw_path": path.encode(), "query_string": b"", "scheme": "http",
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", str(len(data)).encode())],
                 "server": ("test", 80), "client": ("test", 1), "root_path": ""}
        self.task = asyncio.ensure_future(app(scope, self._receive, self._send))

    async def _receive(self) -> Message:
        if self._request is not None:
            request, self._request = self._request, None
            return request
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        if message["type"] != "http.response.body":
            return
        self.waiting = not self.reading.is_set()
        await self.reading.wait()
        self.waiting = False
        self.writes.append(message["body"])
        self.ended = not message.get("more_body", False)

    @property
    def body(self) -> bytes:
        return b"".join(self.writes)

    async def finish(self) -> bytes:
        await asyncio.wait_for(self.task, 10)
        assert self.ended
        return self.body


@pytest.fixture
async def app(options: ProxyOptions, peer: Peer) -> AsyncIterator[Starlette]:
    async with running_app(options) as application:
        yield application


def data_events(body: bytes) -> list[bytes]:
    assert body.endswith(b"\n\n")
    return [e + b"\n\n" for e in body[:-2].split(b"\n\n")]


def expected(path: str, rid: str, created: int, max_tokens: int, n: int) -> bytes:
    """The scripted daemon's stream, one event per record, as dumping each chunk renders it:
    per step, each sequence's token (and its Finish after its last token)."""
    chat = path == "/v1/chat/completions"
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": MODEL}

    def event(index: int, text: str, finish: str | None, first: bool,
              ids: list[int] | None) -> bytes:
        if chat:
            delta: dict[str, str] = {"role": "assistant"} if first else {}
            if text or (first and finish is None):
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None,
                                      "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        if ids is not None:
            choice["token_ids"] = ids
        return b"data: " + orjson.dumps({**head, "choices": [choice], "usage": None}) + b"\n\n"

    out = []
    for k in range(max_tokens):
        for index in range(n):
            out.append(event(index, f"tok{k} ", None, k == 0, [k]))
            if k == max_tokens - 1:
                out.append(event(index, "", "length", False, None))
    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": max_tokens * n,
             "total_tokens": PROMPT_TOKENS + max_tokens * n,
             "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS}}
    out.append(b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def request(path: str, max_tokens: int, n: int = 1, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": max_tokens, "n": n, "stream": True,
                            "stream_options": {"include_usage": True}, "return_token_ids": True,
                            **extra}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return body


def head_of(body: bytes) -> tuple[str, int]:
    first = orjson.loads(data_events(body)[0][6:])
    return first["id"], first["created"]


PATHS = ["/v1/completions", "/v1/chat/completions"]


@pytest.mark.parametrize("path", PATHS)
async def test_a_client_that_keeps_up_gets_one_event_per_record_byte_for_byte(
        app: Starlette, path: str) -> None:
    body = await Client(app, path, request(path, 6, n=2)).finish()
    assert body == expected(path, *head_of(body), max_tokens=6, n=2)


@pytest.mark.parametrize("path", PATHS)
async def test_a_client_that_falls_behind_gets_the_same_bytes_in_fewer_writes(
        app: Starlette, peer: Peer, path: str) -> None:
    client = Client(app, path, request(path, 40, n=2))
    client.reading.clear()
    await wait_until(lambda: len(peer.finished) == 1)  # all of it generated, none of it read
    client.reading.set()
    body = await client.finish()
    assert body == expected(path, *head_of(body), max_tokens=40, n=2)
    # The first write waited; everything that arrived meanwhile went out in the next one.
    assert len(client.writes) <= 3 < len(data_events(body))


@pytest.mark.parametrize("path", PATHS)
async def test_merged_events_carry_the_same_tokens_in_order(options: ProxyOptions, peer: Peer,
                                                           path: str) -> None:
    options = dataclasses.replace(options, stream_merge_tokens=4)
    async with running_app(options) as application:
        # The tokens' logprobs in both shapes (chat: no alternatives)
        extra: dict[str, Any] = {"logprobs": True} if "chat" in path else {"logprobs": 1}
        client = Client(application, path, request(path, 30, n=2, **extra))
        client.reading.clear()
        await wait_until(lambda: len(peer.finished) == 1)
        client.reading.set()
        body = await client.finish()
    events = [orjson.loads(e[6:]) for e in data_events(body)[:-1]]
    assert max(len(e["choices"][0].get("token_ids", ())) for e in events[:-1]) == 4
    for index in (0, 1):
        choices = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == index]
        texts = [c["delta"].get("content", "") if "delta" in c else c["text"] for c in choices]
        assert "".join(texts) == "".join(f"tok{k} " for k in range(30))
        assert [i for c in choices for i in c.get("token_ids", ())] == list(range(30))
        tokens = [lp["token"] for c in choices if c["logprobs"]
                  for lp in c["logprobs"]["content"]] if "delta" in choices[0] else [
            token for c in choices if c["logprobs"] for token in c["logprobs"]["tokens"]]
        assert tokens == [f"tok{k} " for k in range(30)]
        assert choices[-1]["finish_reason"] == "length"
        if "delta" in choices[0]:
            assert choices[0]["delta"]["role"] == "assistant"
        else:  # where each token starts in the choice's text, across merged events
            starts = [sum(len(f"tok{j} ") for j in range(k)) for k in range(30)]
            assert [o for c in choices if c["logprobs"]
                    for o in c["logprobs"]["text_offset"]] == starts
    assert events[-1]["usage"]["completion_tokens"] == 60


async def test_leaving_while_a_write_waits_writes_the_abort_at_once(app: Starlette,
                                                                   peer: Peer) -> None:
    client = Client(app, "/v1/completions", request("/v1/completions", 4000))
    client.reading.clear()
    engine = app.state.engine
    await wait_until(lambda: client.waiting)
    await wait_until(lambda: engine._sessions[peer.submits[0].rid].held > 2)  # more behind it
    client.gone.set()
    await wait_until(lambda: engine.aborts_sent[AbortCause.CLIENT_DISCONNECT] == 1)
    await asyncio.wait_for(client.task, 5)
    assert engine.num_sessions == 0 and not client.ended
    peer.wait_for(lambda p: [(a.rid, a.cause) for a in p.aborts]
                  == [(peer.submits[0].rid, AbortCause.CLIENT_DISCONNECT)])


async def test_flow_control_sees_what_waits_behind_a_write(options: ProxyOptions,
                                                           peer: Peer) -> None:
    options = dataclasses.replace(options, max_buffered_tokens=8)
    async with running_app(options) as application:
        client = Client(application, "/v1/completions", request("/v1/completions", 4000))
        client.reading.clear()
        await wait_until(lambda: [type(r) for r in peer.flow] == [Pause])
        client.reading.set()
        await wait_until(lambda: [type(r) for r in peer.flow[:2]] == [Pause, Resume])
        client.gone.set()
        await asyncio.wait_for(client.task, 5)
        peer.wait_for(lambda p: len(p.aborts) == 1)
