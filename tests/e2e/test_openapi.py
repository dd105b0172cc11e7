"""The published OpenAPI document against a real daemon and proxy: real requests and answers
conform to it, and requests fuzzed from it (schemathesis: bodies, headers, path ids and query
parameters, valid and invalid) never get a 5xx, always get an OpenAI-shaped error when refused
(Anthropic's on /v1/messages), leave no session behind, and all go over one keep-alive
connection without a single lost answer.

Generation lengths are clamped to a few tokens: what is under test is the HTTP edge, not the
engine's speed. Under CI the hypothesis profile fixes the seed (tests/conftest.py).
"""

from __future__ import annotations

import http.client
import re
import select
import socket
from typing import Any

import httpx
import openai
import orjson
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from openapi_schema_validator import OAS31Validator
from schemathesis import Case, GenerationMode
from schemathesis import checks as sc

from tests.support.metrics import m
from tests.support.pair import Server, assert_baseline
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 8
EXAMPLES = 20  # per operation and mode
KEEP_ALIVE_REQUESTS = 400
CHECKS = [sc.not_a_server_error, sc.status_code_conformance, sc.content_type_conformance,
          sc.response_schema_conformance, sc.negative_data_rejection]
FUZZ = settings(max_examples=EXAMPLES, database=None, deadline=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def doc(server: Server) -> dict[str, Any]:
    document: dict[str, Any] = httpx.get(server.url + "/openapi.json").json()
    return document


@pytest.fixture(scope="module")
def api(doc: dict[str, Any]) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_dict(doc)


def _labels() -> list[str]:
    from proxy.openapi import document

    return [f"{method.upper()} {path}" for path, ops in document()["paths"].items()
            for method in ops]


def _modes(op: schemathesis.APIOperation) -> list[GenerationMode]:
    """Negative data needs something to negate: a body or a parameter."""
    negatable = op.body or any(True for _ in op.iter_parameters())
    return [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if negatable else [
        GenerationMode.POSITIVE]


def _bounded(case: Case, mode: GenerationMode) -> Case:
    """Few tokens per request, whatever the fuzzer chose (values past the context stay, so
    that refusal is still exercised)."""
    body = case.body
    if not isinstance(body, dict):
        return case
    fields = ("max_tokens", "max_completion_tokens", "max_output_tokens")
    for name in fields:
        value = body.get(name)
        if type(value) is int and MAX_TOKENS < value <= 2048:
            body[name] = MAX_TOKENS
    if mode is GenerationMode.POSITIVE and all(body.get(name) is None for name in fields):
        body["max_output_tokens" if "input" in body else "max_tokens"] = MAX_TOKENS
    return case


def _assert_openai_error(path: str, status: int, content_type: str, body: bytes) -> None:
    if status < 400 or path == "/health":
        return
    assert content_type.startswith("application/json"), (status, content_type, body[:300])
    if path.startswith("/v1/messages"):  # Anthropic's shape on its API
        answer = orjson.loads(body)
        assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"}, answer
        return
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error


def _wait_idle(server: Server) -> None:
    def idle() -> bool:
        figures = server.metrics()
        return m(figures, "tether_requests_running") + m(figures, "tether_requests_waiting") == 0
    wait_for(idle, 60, "no session running")
    assert_baseline(server.metrics())


# --- real requests and answers conform -----------------------------------------------------------


class Conformance:
    """Checks recorded exchanges against the document: request bodies against their schema,
    JSON answers against the schema of their status, each SSE event against its event schema."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.routes = [(re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+", path) + "$"), path)
                       for path in doc["paths"]]
        self.seen: set[tuple[str, str, int]] = set()

    def _validate(self, schema: dict[str, Any], instance: Any) -> None:
        OAS31Validator({**schema, "components": self.doc["components"]}).validate(instance)

    def check(self, response: httpx.Response) -> None:
        request = response.request
        path = next(t for rx, t in self.routes if rx.match(request.url.path))
        op = self.doc["paths"][path][request.method.lower()]
        if request.content and response.status_code < 400:  # an accepted body fits its schema
            self._validate(op["requestBody"]["content"]["application/json"]["schema"],
                           orjson.loads(request.content))
        answer = op["responses"][str(response.status_code)]
        media = response.headers["content-type"].split(";")[0]
        schema = answer["content"][media]["schema"]
        if media == "text/event-stream":
            data = schema["properties"]["data"]["anyOf"][1]["contentSchema"]
            for line in response.text.splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    self._validate(data, orjson.loads(line[6:]))
        elif media == "application/json":
            self._validate(schema, response.json())
        _assert_openai_error(path, response.status_code, media, response.content)
        self.seen.add((request.method, path, response.status_code))


def test_real_requests_and_answers_match_the_document(server: Server,
                                                      doc: dict[str, Any]) -> None:
    conformance = Conformance(doc)

    def record(response: httpx.Response) -> None:
        response.read()
        conformance.check(response)

    http_client = httpx.Client(event_hooks={"response": [record]}, timeout=60)
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                        http_client=http_client)
    model = oai.models.list().data[0].id
    oai.models.retrieve(model)
    oai.completions.create(model=model, prompt="hello", max_tokens=4, logprobs=2,
                           extra_body={"return_token_ids": True})
    list(oai.completions.create(model=model, prompt=["a", "b"], max_tokens=3, n=2, stream=True,
                                stream_options={"include_usage": True}))
    messages: Any = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    oai.chat.completions.create(model=model, messages=messages, max_tokens=4, n=2,
                                logprobs=True, top_logprobs=2)
    list(oai.chat.completions.create(model=model, messages=messages, max_tokens=4, stream=True))
    created = oai.responses.create(model=model, input="hi", max_output_tokens=4)
    oai.responses.retrieve(created.id)
    oai.responses.input_items.list(created.id)
    list(oai.responses.create(model=model, input="again", previous_response_id=created.id,
                              max_output_tokens=4, stream=True))
    background = oai.responses.create(model=model, input="hi", max_output_tokens=1500,
                                      background=True, extra_body={"ignore_eos": True})
    oai.responses.cancel(background.id)
    oai.responses.delete(created.id)
    user: Any = [{"type": "message", "role": "user", "content": "hi"}]
    conv = oai.conversations.create(items=user, metadata={"k": "v"})
    oai.conversations.retrieve(conv.id)
    oai.conversations.update(conv.id, metadata={"k": "w"})
    oai.responses.create(model=model, input="hi", conversation=conv.id, max_output_tokens=4)
    added = oai.conversations.items.create(conv.id, items=user)
    oai.conversations.items.list(conv.id, order="asc")
    oai.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    oai.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    oai.conversations.delete(conv.id)
    for call in (lambda: oai.responses.retrieve(created.id),
                 lambda: oai.models.retrieve("nope"),
                 lambda: oai.completions.create(model="nope", prompt="x"),
                 lambda: oai.chat.completions.create(model=model, messages=messages,
                                                     max_tokens=-1)):
        with pytest.raises(openai.APIStatusError):
            call()
    for path in ("/health", "/metrics", "/openapi.json"):
        http_client.get(server.url + path)
    # The sampling fields, token ids in and out, echo and continuous usage.
    oai.completions.create(model=model, prompt=[[104, 105], [106]], max_tokens=3, echo=True,
                           logprobs=1, presence_penalty=0.5, frequency_penalty=0.5,
                           logit_bias={"104": 3}, extra_body={
                               "return_token_ids": True, "repetition_penalty": 1.2,
                               "min_p": 0.1, "bad_words": ["x"], "stop_token_ids": [5]})
    list(oai.chat.completions.create(model=model, messages=messages, max_tokens=3, stream=True,
                                     stream_options={"include_usage": True,
                                                     "continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]
    tokens = http_client.post(server.url + "/tokenize", json={"prompt": "hello"}).json()["tokens"]
    http_client.post(server.url + "/tokenize", json={"messages": messages})
    http_client.post(server.url + "/detokenize", json={"tokens": tokens})
    http_client.post(server.url + "/detokenize", json={"tokens": [10**7]})
    # Anthropic's Messages API (its own client takes no httpx client to record with).
    ask: Any = {"model": model, "max_tokens": 4, "system": "be brief",
                "messages": [{"role": "user", "content": "hi"}]}
    for body in (ask, {**ask, "stream": True}, {**ask, "frobnicate": 1}):
        http_client.post(server.url + "/v1/messages", json=body)
    http_client.post(server.url + "/v1/messages/count_tokens",
                     json={k: v for k, v in ask.items() if k != "max_tokens"})
    http_client.close()
    statuses = {(method, path): set() for method, path, _ in conformance.seen}
    for method, path, status in conformance.seen:
        statuses[(method, path)].add(status)
    assert statuses[("GET", "/v1/responses/{response_id}")] == {200, 404}
    assert 400 in statuses[("POST", "/v1/chat/completions")]
    assert 400 in statuses[("POST", "/v1/messages")]
    assert len(statuses) == len([1 for ops in doc["paths"].values() for _ in ops])
    _wait_idle(server)


# --- fuzzing ---------------------------------------------------------------------------------------


def _fuzz(server: Server, op: schemathesis.APIOperation, mode: GenerationMode,
          session: requests.Session) -> None:
    @FUZZ
    @given(case=op.as_strategy(generation_mode=mode))
    def fuzz(case: Case) -> None:
        response = _bounded(case, mode).call(base_url=server.url, session=session, timeout=60)
        case.validate_response(response, checks=CHECKS)
        content_type = (response.headers.get("content-type") or [""])[0]
        _assert_openai_error(case.path, response.status_code, content_type, response.content)

    fuzz()


@pytest.mark.parametrize("label", _labels())
def test_fuzzed_requests_never_get_a_5xx(server: Server, api: schemathesis.BaseSchema,
                                         label: str) -> None:
    op = api.find_operation_by_label(label)
    assert op is not None
    with requests.Session() as session:
        for mode in _modes(op):
            _fuzz(server, op, mode, session)
    _wait_idle(server)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server closed (or sent something unasked) on an idle connection."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def test_one_keep_alive_connection_answers_every_fuzzed_request(
        server: Server, api: schemathesis.BaseSchema) -> None:
    """No answer is ever lost: the server closes a keep-alive connection only after an answer
    that says ``Connection: close``; otherwise every request on it gets its answer."""
    strategies = [op.as_strategy(generation_mode=mode)
                  for op in (api.find_operation_by_label(label) for label in _labels()) if op
                  for mode in _modes(op)]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    tally = {"answered": 0, "announced_closes": 0}

    @settings(FUZZ, max_examples=KEEP_ALIVE_REQUESTS)
    @given(case=st.one_of(strategies))
    def exchange(case: Case) -> None:
        prepared = requests.Request(**_bounded(case, GenerationMode.POSITIVE).as_transport_kwargs(
            base_url=server.url)).prepare()
        if conn.sock is not None:
            assert not _closed_by_peer(conn.sock), (
                f"the server closed the connection after {tally['answered']} answers "
                "without saying so")
        try:
            conn.putrequest(prepared.method or "GET", prepared.path_url, skip_host=True,
                            skip_accept_encoding=True)
            for name, value in prepared.headers.items():
                conn.putheader(name, value)
        except ValueError:  # a header http.client refuses to send; nothing went out
            conn.close()
            return
        body = prepared.body if isinstance(prepared.body, bytes) else (
            prepared.body.encode() if prepared.body else None)
        conn.endheaders(body)
        response = conn.getresponse()  # RemoteDisconnected here is a lost answer
        content = response.read()
        assert response.status < 500, (response.status, content[:500])
        _assert_openai_error(case.path, response.status,
                             response.getheader("content-type", ""), content)
        tally["answered"] += 1
        if response.will_close:
            tally["announced_closes"] += 1
            conn.close()

    exchange()
    conn.close()
    print(f"keep-alive: {tally}")
    assert tally["answered"] >= KEEP_ALIVE_REQUESTS // 2
    _wait_idle(server)


def test_an_idle_keep_alive_connection_outlives_client_pools(server: Server) -> None:
    """Clients keep idle connections for a while (httpx, and so the openai client: 5 s) and send
    on them without warning; a server that closes first races them and loses their request. The
    server announces its own, longer idle timeout, and keeps to it."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/v1/models")
    first = conn.getresponse()
    first.read()
    announced = dict(p.split("=") for p in (first.getheader("keep-alive") or "").split(", ") if p)
    assert int(announced.get("timeout", 0)) >= 60, first.getheaders()
    sock = conn.sock
    assert sock is not None
    ready, _, _ = select.select([sock], [], [], 6.0)  # past uvicorn's default of 5 s
    assert not ready, "the server closed an idle keep-alive connection after under 6 s"
    conn.request("GET", "/v1/models")
    assert conn.getresponse().status == 200 and conn.sock is sock
    conn.close()
