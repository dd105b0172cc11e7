"""POST /tokenize and /detokenize against the scripted daemon: vLLM's request and answer
shapes, what the Submit carries, and the refusals that name their field."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from ipc.records import RequestKind
from proxy.options import ProxyOptions
from tests.proxy.conftest import running_app
from tests.support.peer import MAX_MODEL_LEN, Peer

pytestmark = pytest.mark.anyio


async def test_tokenize_a_prompt_and_messages(client: httpx.AsyncClient, peer: Peer) -> None:
    r = await client.post("/tokenize", json={"prompt": "hé"})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 3, "max_model_len": MAX_MODEL_LEN, "tokens": list("hé".encode())}
    submit = peer.submits[-1]
    assert (submit.kind, submit.prompts, submit.add_special_tokens) == (
        RequestKind.TOKENIZE, ["hé"], None)
    r = await client.post("/tokenize", json={
        "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False,
        "add_special_tokens": True, "model": "test-model"})
    assert r.status_code == 200, r.text
    submit = peer.submits[-1]
    assert [(m.role, m.content) for m in submit.messages] == [("user", "hi")]
    assert (submit.add_generation_prompt, submit.add_special_tokens) == (False, True)
    r = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert peer.submits[-1].add_generation_prompt is True


async def test_detokenize_round_trips(client: httpx.AsyncClient, peer: Peer) -> None:
    tokens = (await client.post("/tokenize", json={"prompt": "日本 ok"})).json()["tokens"]
    r = await client.post("/detokenize", json={"tokens": tokens})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": "日本 ok"}
    assert peer.submits[-1].prompt_ids == [tokens]
    r = await client.post("/detokenize", json={"tokens": [1000]})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "tokens")


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "a", "return_token_strs": True}, "return_token_strs"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {}, "tokens"),
])
async def test_refusals_name_the_field(client: httpx.AsyncClient, peer: Peer, path: str,
                                       body: dict[str, object], param: str) -> None:
    r = await client.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
    assert not peer.submits  # refused by the proxy: nothing went to the daemon


async def test_the_api_key_guards_them(options: ProxyOptions, peer: Peer) -> None:
    options = dataclasses.replace(options, api_keys=("k",))
    async with running_app(options) as app:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://p") as c:
            for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
                assert (await c.post(path, json=body)).status_code == 401
                r = await c.post(path, json=body, headers={"Authorization": "Bearer k"})
                assert r.status_code == 200, r.text
