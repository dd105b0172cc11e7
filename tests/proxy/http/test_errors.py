"""Input that once got a 5xx: every one is a 4xx in the OpenAI shape, and nothing is logged as a
crash (the handler of last resort logs "unhandled error")."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from starlette.types import Message

from ipc.reasons import Reason
from proxy.app import create_app
from proxy.http.errors import CLIENT_CLOSED_REQUEST, refused
from proxy.options import ProxyOptions
from tests.support.peer import Peer
from tests.support.wait import wait_until

pytestmark = pytest.mark.anyio

# Nested under a field of each route that takes any JSON object (an unknown field is refused
# before its value is read).
ANY_OBJECT = {"/v1/completions": b"suffix", "/v1/chat/completions": b"prompt_cache_options",
              "/v1/responses": b"prompt_cache_options"}


def deep(path: str) -> bytes:
    return b'{"' + ANY_OBJECT[path] + b'":' + b'{"a":' * 3000 + b"1" + b"}" * 3001


def _no_crash(caplog: pytest.LogCaptureFixture) -> None:
    crashes = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not crashes, crashes


def _openai_error(r: httpx.Response, status: int) -> dict[str, str | None]:
    assert r.status_code == status, r.text
    error: dict[str, str | None] = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
async def test_deeply_nested_json_is_400(client: httpx.AsyncClient, path: str,
                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        error = _openai_error(await client.post(path, content=deep(path)), 400)
    assert error["code"] == "invalid_json" and "nested" in (error["message"] or "")
    _no_crash(caplog)


async def test_responses_input_nested_past_its_type_is_400(
        client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    # Deep enough to decode, too deep to be a message: an item is as deep as its type, so the
    # field that holds the rest is refused (by name) before it reaches the daemon; where a
    # part may hold JSON of its own (logprobs, skipped), the decoder's depth bound refuses it.
    item = b'{"role": "user", "content": "hi", "extra": ' + b"[" * 200 + b"]" * 200 + b"}"
    deep = (b'{"role": "assistant", "content": [{"type": "output_text", "text": "x", '
            b'"logprobs": ' + b"[" * 3000 + b"]" * 3000 + b"}]}")
    with caplog.at_level(logging.WARNING):
        error = _openai_error(await client.post(
            "/v1/responses", content=b'{"input": [' + item + b"]}"), 400)
        assert error["param"] == "input[0].extra" and error["code"] == "unknown_parameter"
        error = _openai_error(await client.post(
            "/v1/responses", content=b'{"input": [' + deep + b"]}"), 400)
        assert "nested" in (error["message"] or "")
    _no_crash(caplog)


@pytest.mark.parametrize(("method", "suffix"), [("GET", ""), ("DELETE", ""),
                                                ("POST", "/cancel"), ("GET", "/input_items")])
async def test_a_response_id_that_cannot_exist_is_400(
        client: httpx.AsyncClient, method: str, suffix: str,
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        for rid in ("r" * 4000, "resp_%20x", "a" * 129):
            r = await client.request(method, f"/v1/responses/{rid}{suffix}")
            error = _openai_error(r, 400)
            assert error["param"] == "response_id" and error["code"] == "invalid_value"
    _no_crash(caplog)


async def test_a_client_leaving_while_its_body_is_read_is_not_a_crash(
        options: ProxyOptions, peer: Peer, caplog: pytest.LogCaptureFixture) -> None:
    app = create_app(options)
    async with app.router.lifespan_context(app):
        await wait_until(lambda: app.state.engine.up)
        pending: list[Message] = [{"type": "http.request", "body": b'{"prompt": ',
                                   "more_body": True}, {"type": "http.disconnect"}]
        sent: list[Message] = []

        async def receive() -> Message:
            if pending:
                return pending.pop(0)
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

        async def send(message: Message) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": "1.1", "method": "POST", "path": "/v1/completions",
                 "raw_path": b"/v1/completions", "query_string": b"", "headers": [],
                 "scheme": "http", "server": ("test", 80), "client": ("test", 1),
                 "root_path": ""}
        with caplog.at_level(logging.WARNING):
            await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == CLIENT_CLOSED_REQUEST
    assert not peer.submits
    _no_crash(caplog)


@pytest.mark.parametrize(("query", "param"), [("stream=null", "stream"),
                                              ("starting_after=1.5", "starting_after"),
                                              ("stream=true&starting_after=-2", "starting_after")])
async def test_query_parameters_are_parsed_strictly(client: httpx.AsyncClient, query: str,
                                                    param: str) -> None:
    error = _openai_error(await client.get(f"/v1/responses/resp_x?{query}"), 400)
    assert error["param"] == param


async def test_input_items_limit_is_digits_only(client: httpx.AsyncClient) -> None:
    error = _openai_error(await client.get("/v1/responses/resp_x/input_items?limit=%205"), 400)
    assert error["param"] == "limit"


# What clients heard for each refusal when the daemon still chose the status and the code: the
# proxy's table must keep it (docs/api.md's errors; the e2e tests pin many of them too).
HEARD = {
    Reason.INVALID: (400, "invalid_request_error", None),
    Reason.CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error", "context_length_exceeded"),
    Reason.TOO_MANY_SEQUENCES: (400, "invalid_request_error", "too_many_sequences"),
    Reason.MAX_TOKENS_TOO_SMALL: (400, "invalid_request_error", "max_tokens_too_small"),
    Reason.INVALID_GRAMMAR: (400, "invalid_request_error", "invalid_grammar"),
    Reason.GRAMMAR_TOO_COMPLEX: (400, "invalid_request_error", "grammar_too_complex"),
    Reason.GRAMMAR_TIMEOUT: (400, "invalid_request_error", "grammar_timeout"),
    Reason.CONVERSATION_FULL: (400, "invalid_request_error", "conversation_full"),
    Reason.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    Reason.PREVIOUS_RESPONSE_NOT_FOUND: (404, "invalid_request_error",
                                         "previous_response_not_found"),
    Reason.DUPLICATE_ID: (409, "invalid_request_error", None),
    Reason.CONVERSATION_LOCKED: (409, "invalid_request_error", "conversation_locked"),
    Reason.TOO_LARGE: (413, "invalid_request_error", None),
    Reason.NO_STORE: (500, "server_error", None),
    Reason.STORE_ERROR: (500, "server_error", "store_error"),
    Reason.STORE_TIMEOUT: (503, "service_unavailable", "store_timeout"),
    Reason.INTERNAL: (500, "server_error", "internal_error"),
    Reason.VERSION_MISMATCH: (500, "server_error", "version_mismatch"),
    Reason.SHUTTING_DOWN: (503, "service_unavailable", None),
    Reason.NOT_APPLIED: (503, "service_unavailable", None),
}


@pytest.mark.parametrize("reason", list(Reason))
def test_each_reason_the_daemon_refuses_for_reads_as_it_always_did(reason: Reason) -> None:
    body = refused(reason, "why, naming the limit", "max_tokens").body()["error"]
    status = refused(reason, "m").status
    assert (status, body["type"], body["code"]) == HEARD[reason]
    assert (body["message"], body["param"]) == ("why, naming the limit", "max_tokens")
