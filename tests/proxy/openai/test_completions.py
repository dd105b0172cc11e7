"""The completions and chat routes in-process, against the scripted daemon on real FIFOs."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import orjson
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from ipc.records import RequestKind, TokenLogprob
from proxy.app import create_app
from proxy.engine.collected import collected_bytes
from proxy.openai.completion_answer import CHAT, COMPLETION
from proxy.options import ProxyOptions
from tests.proxy.conftest import running_app
from tests.support.peer import MODEL, ROOM, Peer
from tests.support.raw_http import sse_events
from tests.support.wait import wait_until

pytestmark = pytest.mark.anyio


async def test_completion_choices_cover_prompts_times_n(client: httpx.AsyncClient,
                                                        peer: Peer) -> None:
    r = await client.post("/v1/completions", json={
        "prompt": ["first", "second"], "n": 2, "max_tokens": 3, "seed": 1, "model": MODEL})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == "tok0 tok1 tok2 " and c["finish_reason"] == "length"
               for c in body["choices"])
    # Each prompt's tokens once, not once per sample; cached ones too.
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 12, "total_tokens": 18,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    submit = peer.submits[-1]
    assert submit.kind is RequestKind.COMPLETION and submit.prompts == ["first", "second"]
    assert (submit.n, submit.sampling.max_tokens, submit.sampling.seed) == (2, 3, 1)
    assert submit.rid == body["id"] == r.headers["x-request-id"] and submit.client_id is None


async def test_completion_stream_ends_with_usage_and_done(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={
        "prompt": "p", "max_tokens": 2, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    got = sse_events(r.text)
    assert got[-1] == "[DONE]"
    chunks = [e for e in got[:-1] if isinstance(e, dict)]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "tok0 tok1 "
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_chat_non_streaming_shape(client: httpx.AsyncClient, peer: Peer) -> None:
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
        "max_completion_tokens": 2, "max_tokens": 9, "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert [c["message"] for c in body["choices"]] == [
        {"role": "assistant", "content": "tok0 tok1 "}] * 2
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 4
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    submit = peer.submits[-1]
    assert submit.kind is RequestKind.CHAT and submit.sampling.max_tokens == 2
    assert [m.role for m in submit.messages] == ["system", "user"]


async def test_chat_stream_deltas(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
    got = sse_events(r.text)
    assert got[-1] == "[DONE]"
    deltas = [e["choices"][0] for e in got[:-1] if isinstance(e, dict)]
    assert deltas[0]["delta"]["role"] == "assistant"
    assert "".join(d["delta"].get("content", "") for d in deltas) == "tok0 tok1 "
    assert deltas[-1]["finish_reason"] == "length" and "usage" not in got[0]


async def test_daemon_rejection_keeps_its_status_and_param(client: httpx.AsyncClient) -> None:
    for stream in (False, True):
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "TOO LONG"}], "stream": stream})
        assert r.status_code == 400
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")


async def test_x_request_id_is_echoed_never_the_key(client: httpx.AsyncClient,
                                                    peer: Peer) -> None:
    r = await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 1},
                          headers={"X-Request-Id": "mine-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "mine-1"
    submit = peer.submits[-1]
    assert r.json()["id"] == submit.rid != "mine-1" and submit.client_id == "mine-1"
    # Two requests with one X-Request-Id at once: both served, under keys of their own.
    peer.hold = True
    first = asyncio.ensure_future(client.post(
        "/v1/completions", headers={"X-Request-Id": "dup"}, json={"prompt": "p", "max_tokens": 1}))
    await wait_until(lambda: any(s.client_id == "dup" for s in peer.submits))
    second = asyncio.ensure_future(client.post(
        "/v1/completions", headers={"X-Request-Id": "dup"}, json={"prompt": "p", "max_tokens": 1}))
    await wait_until(lambda: sum(s.client_id == "dup" for s in peer.submits) == 2)
    peer.hold = False
    answers = [await first, await second]
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].json()["id"] != answers[1].json()["id"]


async def test_too_many_waiting_is_429(options: ProxyOptions, peer: Peer) -> None:
    options = dataclasses.replace(options, max_waiting=1)
    app = create_app(options)
    peer.hold = True
    async with app.router.lifespan_context(app):
        await wait_until(lambda: app.state.engine.up)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://p") as c:
            queued = asyncio.ensure_future(
                c.post("/v1/completions", json={"prompt": "p", "max_tokens": 1}))
            await wait_until(lambda: app.state.engine.num_waiting == 1)
            r = await c.post("/v1/completions", json={"prompt": "p", "max_tokens": 1})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            peer.hold = False
            assert (await queued).status_code == 200


LINE_BREAKS = "a\u2028b\x85c\u2029d\r\ne\x1cf"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
async def test_text_with_unicode_line_breaks_streams_one_event_per_line(
        client: httpx.AsyncClient, path: str) -> None:
    # Clients that split with str.splitlines() (httpx's aiter_lines) must still see whole events.
    prompt = "echo:" + LINE_BREAKS
    body: dict[str, object] = {"stream": True}
    if path == "/v1/completions":
        body |= {"prompt": prompt, "max_tokens": 2}
    elif path == "/v1/chat/completions":
        body |= {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    else:
        body |= {"input": prompt, "max_output_tokens": 2, "store": False}
    texts = []
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = orjson.loads(line[6:])
                if path == "/v1/completions":
                    texts += [c["text"] for c in event["choices"]]
                elif path == "/v1/chat/completions":
                    texts += [c["delta"].get("content", "") for c in event["choices"]]
                elif event["type"] == "response.output_text.delta":
                    texts.append(event["delta"])
            else:
                assert line == "" or line.startswith("event: ") or line == "data: [DONE]", line
    assert "".join(texts) == LINE_BREAKS * 2


async def test_chat_logprobs_in_openai_shape(client: httpx.AsyncClient, peer: Peer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
            "top_logprobs": 2}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert peer.submits[-1].sampling.logprobs == 2
    parsed = ChatCompletion.model_validate(r.json())
    content = parsed.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [c.token for c in content] == ["tok0 ", "tok1 "]
    assert content[0].logprob == -0.25 and content[0].bytes == list(b"tok0 ")
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("tok0 ", -0.25),
                                                                        ("alt", -1.5)]
    r = await client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [ChatCompletionChunk.model_validate(e) for e in sse_events(r.text) if isinstance(e, dict)]
    streamed = [c.token for chunk in chunks for choice in chunk.choices
                if choice.logprobs is not None for c in choice.logprobs.content or ()]
    assert streamed == ["tok0 ", "tok1 "]
    # Without logprobs the field stays null and nothing is asked of the daemon.
    r = await client.post("/v1/chat/completions", json={**body, "logprobs": False,
                                                        "top_logprobs": None})
    assert r.json()["choices"][0]["logprobs"] is None and peer.submits[-1].sampling.logprobs is None


async def test_completion_logprobs_in_legacy_shape(client: httpx.AsyncClient,
                                                   peer: Peer) -> None:
    r = await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 2, "logprobs": 1})
    assert r.status_code == 200, r.text
    assert peer.submits[-1].sampling.logprobs == 1
    lp = Completion.model_validate(r.json()).choices[0].logprobs
    assert lp is not None and lp.tokens == ["tok0 ", "tok1 "]
    assert lp.token_logprobs == [-0.25, -0.25] and lp.text_offset == [0, 5]
    assert lp.top_logprobs == [{"tok0 ": -0.25}, {"tok1 ": -0.25}]
    r = await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 2, "logprobs": 0,
                                                   "stream": True})
    got = [e["choices"][0]["logprobs"] for e in sse_events(r.text) if isinstance(e, dict)]
    assert [g["text_offset"] for g in got if g] == [[0], [5]]
    assert all(g["top_logprobs"] == [{}] for g in got if g)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
])
async def test_bad_logprobs_are_400_naming_the_field(client: httpx.AsyncClient, path: str,
                                                     body: dict[str, object], param: str) -> None:
    r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_logprob_tokens_split_inside_a_character_keep_their_bytes() -> None:
    sun = "日".encode()
    lps = [TokenLogprob(b"a", -0.1, [(b"a", -0.1)]), TokenLogprob(sun[:2], -0.2, [(sun[:1], -0.2)]),
           TokenLogprob(sun[2:], -0.3), TokenLogprob(b" b", -0.4)]
    chat = CHAT.logprobs(lps, 0)["content"]
    assert [t["token"] for t in chat] == ["a", "\\xe6\\x97", "\\xa5", " b"]
    assert b"".join(bytes(t["bytes"]) for t in chat).decode() == "a日 b"
    assert chat[1]["top_logprobs"] == [{"token": "\\xe6", "logprob": -0.2, "bytes": [0xE6]}]
    legacy = COMPLETION.logprobs(lps, 10)
    assert legacy["tokens"] == ["a", "\\xe6\\x97", "\\xa5", " b"]
    assert legacy["text_offset"] == [10, 11, 11, 12]  # the split character starts at 11
    assert legacy["top_logprobs"][1] == {"\\xe6": -0.2}


@pytest.mark.parametrize(("path", "body", "param", "sequences"), [
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}, "n", 6),
    ("/v1/completions", {"prompt": ["p"] * 5}, "prompt", 5),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 5}, "n", 5),
])
async def test_more_sequences_than_the_cap_is_400_naming_the_field(
        options: ProxyOptions, peer: Peer, path: str, body: dict[str, object], param: str,
        sequences: int) -> None:
    options = dataclasses.replace(options, max_seqs_per_request=4)
    async with running_app(options) as app:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://p") as c:
            for stream in (False, True):
                r = await c.post(path, json={**body, "max_tokens": 1, "stream": stream})
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert (error["param"], error["code"]) == (param, "too_many_sequences")
                assert f"{sequences} sequences" in error["message"]
                assert "limit of 4 per request" in error["message"]
            at_cap = {**body, "n": 1, "prompt": ["a"] * 4} if "prompt" in body else {**body, "n": 4}
            r = await c.post(path, json={**at_cap, "max_tokens": 1})
            assert r.status_code == 200, r.text
    assert [s.num_sequences for s in peer.submits] == [4]  # the refused never went out


async def test_what_a_collected_answer_could_hold_is_bounded_up_front(
        options: ProxyOptions, peer: Peer) -> None:
    options = dataclasses.replace(options, max_collected_bytes=2_000_000)
    big = {"prompt": ["a", "b"], "n": 4, "max_tokens": 100, "logprobs": 20}
    async with running_app(options) as app:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://p") as c:
            r = await c.post("/v1/completions", json=big)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["param"], error["code"]) == ("max_tokens", "output_too_large")
            assert "limit of 2000000" in error["message"] and "stream" in error["message"]
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "n": 8, "logprobs": True,
                "top_logprobs": 20, "max_completion_tokens": 100})
            assert r.status_code == 400
            assert r.json()["error"]["param"] == "max_completion_tokens"
            assert not peer.submits
            # Streamed, nothing is collected; without logprobs, it fits.
            r = await c.post("/v1/completions", json={**big, "max_tokens": 2, "stream": True})
            assert r.status_code == 200
            r = await c.post("/v1/completions", json={**big, "logprobs": None})
            assert r.status_code == 200 and len(r.json()["choices"]) == 8


async def test_without_max_tokens_the_budget_counts_what_comes(options: ProxyOptions,
                                                               peer: Peer) -> None:
    """An omitted max_tokens is the rest of the context: never refused up front for a bound the
    client did not set, only once what it collects passes --max-collected-bytes."""
    limit = collected_bytes(1, 20, None)  # the scripted daemon's answers are 16 tokens each
    options = dataclasses.replace(options, max_collected_bytes=limit)
    chat = {"messages": [{"role": "user", "content": "x"}]}
    async with running_app(options) as app:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://p") as c:
            r = await c.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == ROOM
            assert peer.submits[-1].sampling.max_tokens is None
            r = await c.post("/v1/chat/completions", json={**chat, "max_tokens": 100})
            assert r.status_code == 400 and r.json()["error"]["code"] == "output_too_large"
            r = await c.post("/v1/chat/completions", json={**chat, "n": 2})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["param"], error["code"]) == ("max_tokens", "output_too_large")
            assert "stream" in error["message"]
    peer.wait_for(lambda p: any(a.rid == peer.submits[-1].rid for a in p.aborts))
