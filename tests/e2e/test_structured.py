"""Structured outputs through the official openai client on a real pair (builtin:tiny's random
weights, sampled at temperature 1: whatever is valid comes from the constraint): chat and
Responses under a JSON schema, the client's own pydantic parsing, JSON mode, vLLM's regex and
choice on completions, and the refusals; no session is left behind."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import orjson
import pydantic
import pytest

from tests.support.pair import Server, assert_baseline

pytestmark = pytest.mark.timeout(300)

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=130)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_chat_json_schema_is_valid_every_time(server: Server, client: openai.OpenAI,
                                              model: str) -> None:
    for seed in range(4):
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Describe a person."}],
            max_tokens=96, temperature=1.0, seed=seed, response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
        [choice] = r.choices
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    assert_baseline(server.metrics())


def test_chat_streamed_json_schema_adds_up_to_valid_json(client: openai.OpenAI,
                                                         model: str) -> None:
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A person."}], max_tokens=96,
        stream=True, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_the_clients_pydantic_parse(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "A person."}], max_tokens=64,
        response_format=Person)
    assert isinstance(r.choices[0].message.parsed, Person)
    got = client.responses.parse(model=model, input="A person.", max_output_tokens=64,
                                 text_format=Person)
    assert isinstance(got.output_parsed, Person)


def test_responses_text_format_is_honoured_and_echoed(client: openai.OpenAI, model: str) -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client.responses.create(model=model, input="A person.", max_output_tokens=96,
                                text={"format": fmt})  # type: ignore[typeddict-item]
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format is not None and r.text.format.type == "json_schema"
    assert client.responses.retrieve(r.id).text.format.type == "json_schema"  # type: ignore[union-attr]


def test_json_mode_and_vllms_regex_and_choice(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "JSON please."}], max_tokens=48,
        response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    c = client.completions.create(model=model, prompt="Date:", max_tokens=16,
                                  extra_body={"structured_outputs": {"regex": r"\d{4}-\d\d-\d\d"}})
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", c.choices[0].text)
    c = client.completions.create(model=model, prompt="Pick:", max_tokens=8,
                                  extra_body={"guided_choice": ["red", "green", "blue"]})
    assert c.choices[0].text in ("red", "green", "blue")


def test_json_mode_answers_parse_under_a_strict_parser(client: openai.OpenAI, model: str) -> None:
    """RFC 8259 JSON, as orjson and JavaScript read it: no NaN or Infinity, nor a number that
    overflows to one (a random model writes 1e999), no lone surrogate."""
    for seed in range(12):
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "JSON please."}], max_tokens=160,
            temperature=1.0, seed=seed, response_format={"type": "json_object"})
        text = r.choices[0].message.content or ""
        assert isinstance(orjson.loads(text), dict), text


def test_a_budget_too_small_names_the_one_that_fits(client: openai.OpenAI, model: str) -> None:
    messages: Any = [{"role": "user", "content": "x"}]
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "n", "schema": PERSON}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=messages, max_tokens=3,
                                       response_format=fmt)
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "max_tokens", body
    found = re.search(r"set max_tokens to at least (\d+)", body["message"])
    assert found, body
    need = int(found.group(1))
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=need,
                                       response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), PERSON)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=messages, max_tokens=need - 1,
                                       response_format=fmt)


def test_refusals_name_the_field(server: Server, client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "x"}]
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": 5}}},
         "response_format"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}},
         None),  # two guides: both are named in the message
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n",
                                                                      "schema": PERSON}},
          "max_tokens": 3}, "max_tokens"),  # no valid answer fits
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                           **extra)
        body = info.value.body
        assert isinstance(body, dict)
        if param is not None:
            assert body["param"] is not None and body["param"].startswith(param), body
        else:
            assert "response_format" in body["message"] and "guided_regex" in body["message"]
    assert_baseline(server.metrics())


def test_the_response_object_echoes_what_was_asked(client: openai.OpenAI, model: str) -> None:
    """As sent, on create and on every GET: metadata, tool_choice, parallel_tool_calls, tools;
    times as integer Unix seconds."""
    tools: list[Any] = [{"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}]
    r = client.responses.create(model=model, input="hi", max_output_tokens=200,
                                metadata={"user": "ada", "run": "7"}, tools=tools,
                                tool_choice="required", parallel_tool_calls=False)
    for got in (r, client.responses.retrieve(r.id)):
        assert got.metadata == {"user": "ada", "run": "7"}
        assert got.tool_choice == "required" and got.parallel_tool_calls is False
        assert [t.name for t in got.tools] == ["f"]  # type: ignore[union-attr]
        assert isinstance(got.created_at, int) or float(got.created_at).is_integer()
        assert got.completed_at is None or float(got.completed_at).is_integer()
        assert [i.type for i in got.output] == ["function_call"]
