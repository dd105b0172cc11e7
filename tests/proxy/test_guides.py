"""Structured-output fields into the Guide the daemon compiles: every spelling, the cheap
checks, what is refused by name, and the Responses echo of text.format."""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgspec
import pytest

from ipc.records import Guide, GuideKind
from proxy.bodies import decode_body
from proxy.guides import MAX_GUIDE_BYTES, request_guide, text_echo, text_guide
from proxy.http.errors import ApiError
from proxy.openai.schemas import ChatRequest, CompletionRequest
from proxy.responses.request import CreateResponse
from tests.support.peer import Peer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SPEC = json.dumps(SCHEMA, separators=(",", ":"))
# As a strict format reads it: its objects take only the properties they list.
CLOSED = json.dumps({**SCHEMA, "additionalProperties": False}, separators=(",", ":"))
MESSAGES = [{"role": "user", "content": "hi"}]


def chat_guide(**fields: Any) -> Guide | None:
    body = json.dumps({"messages": MESSAGES, **fields}).encode()
    return request_guide(decode_body(body, ChatRequest))


def test_a_strict_formats_objects_take_only_the_properties_they_list() -> None:
    def fmt(strict: bool | None) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA,
                                                       "strict": strict}}

    assert chat_guide(response_format=fmt(True)) == Guide(
        GuideKind.JSON_SCHEMA, CLOSED, "response_format")
    for strict in (False, None):  # JSON Schema's own reading: others allowed
        assert chat_guide(response_format=fmt(strict)) == Guide(
            GuideKind.JSON_SCHEMA, SPEC, "response_format")


def refusal(**fields: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        chat_guide(**fields)
    assert info.value.status == 400
    return info.value


def test_every_spelling_becomes_its_guide_named_by_its_field() -> None:
    cases = {
        "response_format": ({"type": "json_schema", "json_schema": {
            "name": "thing", "schema": SCHEMA}}, GuideKind.JSON_SCHEMA, SPEC),
        "structured_outputs": ({"regex": "[0-9]+"}, GuideKind.REGEX, "[0-9]+"),
        "guided_json": (SCHEMA, GuideKind.JSON_SCHEMA, SPEC),
        "guided_regex": ("a|b", GuideKind.REGEX, "a|b"),
        "guided_choice": (["yes", "no"], GuideKind.CHOICE, '["yes","no"]'),
        "guided_grammar": ('start: "x"', GuideKind.GRAMMAR, 'start: "x"'),
    }
    for field, (value, kind, spec) in cases.items():
        guide = chat_guide(**{field: value})
        assert guide is not None and (guide.kind, guide.spec) == (kind, spec), field
        assert guide.source == ("structured_outputs.regex" if field == "structured_outputs"
                                else field)
    assert chat_guide(response_format={"type": "json_object"}) == Guide(
        GuideKind.JSON_OBJECT, source="response_format")
    assert chat_guide(structured_outputs={"json_object": True}) == Guide(
        GuideKind.JSON_OBJECT, source="structured_outputs.json_object")
    # A schema as a JSON string (vLLM takes both) is passed on as it was written.
    assert chat_guide(guided_json=json.dumps(SCHEMA)) == Guide(
        GuideKind.JSON_SCHEMA, json.dumps(SCHEMA), "guided_json")
    for so in ({"json": SCHEMA}, {"choice": ["a"]}, {"grammar": "root ::= \"a\""}):
        guide = chat_guide(structured_outputs=so)
        assert guide is not None and guide.source == "structured_outputs." + next(iter(so))


def test_free_text_and_no_ops_give_no_guide() -> None:
    assert chat_guide() is None
    assert chat_guide(response_format={"type": "text"}) is None
    assert chat_guide(guided_decoding_backend="xgrammar") is None
    guide = chat_guide(structured_outputs={"regex": "a", "disable_any_whitespace": True,
                                           "disable_fallback": True})
    assert guide is not None and guide.kind is GuideKind.REGEX


def test_completions_take_the_same_fields() -> None:
    body = json.dumps({"prompt": "p", "response_format": {"type": "json_object"}}).encode()
    assert request_guide(decode_body(body, CompletionRequest)) == Guide(
        GuideKind.JSON_OBJECT, source="response_format")


def test_two_guides_are_a_400_naming_both() -> None:
    e = refusal(response_format={"type": "json_object"}, guided_regex="a")
    assert "'response_format'" in e.message and "'guided_regex'" in e.message
    assert e.param == "guided_regex"
    e = refusal(structured_outputs={"regex": "a", "choice": ["b"]})
    assert "structured_outputs.regex" in e.message and e.param == "structured_outputs.choice"


def test_what_cannot_be_honoured_is_refused_by_name() -> None:
    for fields, param in (
            ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
            ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}},
             "structured_outputs.whitespace_pattern"),
            ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
            ({"structured_outputs": {"regex": "a", "disable_additional_properties": True}},
             "structured_outputs.disable_additional_properties")):
        e = refusal(**fields)
        assert (e.param, e.code) == (param, "unsupported_parameter"), fields
    assert refusal(structured_outputs={}).param == "structured_outputs"


def test_the_cheap_checks_name_the_field() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}
    assert refusal(response_format=fmt).param == "response_format.json_schema.schema"
    fmt = {"type": "json_schema", "json_schema": {"name": "no spaces", "schema": {}}}
    assert refusal(response_format=fmt).param == "response_format.json_schema.name"
    fmt = {"type": "json_schema", "json_schema": {"schema": {}}}
    assert refusal(response_format=fmt).code == "missing_required_parameter"
    # The Responses shape sent to chat: told, not ignored.
    fmt = {"type": "json_schema", "name": "x", "schema": {}}
    assert refusal(response_format=fmt).code == "unknown_parameter"
    assert refusal(response_format={"type": "regex"}).param == "response_format.type"
    assert refusal(guided_choice=[]).param == "guided_choice"
    assert refusal(guided_choice=["a", 1]).param == "guided_choice[1]"
    assert refusal(guided_json="[1, 2]").param == "guided_json"
    assert refusal(guided_json="{nope").param == "guided_json"
    assert refusal(guided_regex="").param == "guided_regex"
    assert refusal(structured_outputs={"nope": 1}).code == "unknown_parameter"


def test_specs_are_bounded_in_bytes() -> None:
    big = {"type": "object", "description": "é" * (MAX_GUIDE_BYTES // 2)}
    e = refusal(guided_json=big)
    assert e.param == "guided_json" and str(MAX_GUIDE_BYTES) in e.message
    assert refusal(guided_regex="a" * (MAX_GUIDE_BYTES + 1)).param == "guided_regex"
    ok = {"type": "object", "description": "x" * (MAX_GUIDE_BYTES - 100)}
    assert chat_guide(guided_json=ok) is not None


def responses_text(text: Any) -> CreateResponse:
    return decode_body(json.dumps({"input": "hi", "text": text}).encode(), CreateResponse)


def test_text_format_is_the_responses_guide_and_is_echoed() -> None:
    fmt = {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}
    req = responses_text({"format": fmt, "verbosity": "low"})
    assert text_guide(req.text) == Guide(GuideKind.JSON_SCHEMA, CLOSED, "text.format")
    assert text_echo(req.text) == {"format": fmt, "verbosity": "low"}  # as the client sent it
    req = responses_text({"format": {"type": "json_object"}})
    assert text_guide(req.text) == Guide(GuideKind.JSON_OBJECT, source="text.format")
    for text in ({"format": {"type": "text"}}, {"verbosity": "high"}):
        assert text_guide(responses_text(text).text) is None
    assert text_echo(None) == {"format": {"type": "text"}}
    assert text_echo(responses_text({"verbosity": "high"}).text) == {
        "format": {"type": "text"}, "verbosity": "high"}
    with pytest.raises(ApiError) as info:
        responses_text({"format": {"type": "json_schema", "json_schema": {}}})
    assert info.value.param == "text.format.json_schema"


# --- through the app, to the scripted daemon -------------------------------------------------------

@pytest.mark.anyio
async def test_the_submit_carries_the_guide(client: httpx.AsyncClient, peer: Peer) -> None:
    r = await client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 3, "guided_regex": "[a-z]+"})
    assert r.status_code == 200, r.text
    assert peer.submits[-1].sampling.guide == Guide(GuideKind.REGEX, "[a-z]+", "guided_regex")
    r = await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 3})
    assert r.status_code == 200 and peer.submits[-1].sampling.guide is None


@pytest.mark.anyio
async def test_a_response_echoes_its_text_format(client: httpx.AsyncClient, peer: Peer) -> None:
    text = {"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA,
                       "strict": True}}
    r = await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3,
                                                 "text": text})
    assert r.status_code == 200, r.text
    assert r.json()["text"] == text
    assert peer.submits[-1].sampling.guide == Guide(GuideKind.JSON_SCHEMA, CLOSED, "text.format")
    r = await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3,
                                                 "stream": True, "text": text})
    events = [msgspec.json.decode(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ")]
    assert all(e["response"]["text"] == text for e in events if "response" in e)
    assert events[-1]["type"] == "response.incomplete"  # the scripted daemon ends at length
