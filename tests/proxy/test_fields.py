"""The field table: every field OpenAI's client can send is declared, docs/api.md and the
OpenAPI document say what the validation does, and each mark does what it says."""

from __future__ import annotations

import typing
from pathlib import Path

import msgspec
import pytest
from anthropic.types import message_count_tokens_params, message_create_params
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from proxy.bodies import decode_body
from proxy.field_table import endpoints, markdown
from proxy.fields import HONOURED, NO_OP, REFUSED, table
from proxy.http.errors import ApiError
from proxy.openapi import document

DOCS = Path(__file__).parents[2] / "docs" / "api.md"
# Each route's body as the openai client types it (its streaming variants add `stream`).
CLIENT_TYPES = {
    "/v1/completions": completion_create_params.CompletionCreateParamsBase,
    "/v1/chat/completions": chat_create_params.CompletionCreateParamsBase,
    "/v1/responses": response_create_params.ResponseCreateParamsBase,
    # Anthropic's, as its client types them.
    "/v1/messages": message_create_params.MessageCreateParamsBase,
    "/v1/messages/count_tokens": message_count_tokens_params.MessageCountTokensParams,
}
ANTHROPIC = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MINIMAL = {"/v1/completions": {"prompt": "hi"},
           "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
           "/v1/responses": {"input": "hi"},
           "/v1/messages": {**ANTHROPIC, "max_tokens": 1},
           "/v1/messages/count_tokens": ANTHROPIC}
# A nested object whose unknown field is named with its path.
NESTED = {"/v1/messages": {"metadata": {"frobnicate": 1}},
          "/v1/messages/count_tokens": {"thinking": {"type": "adaptive", "frobnicate": 1}}}


def test_docs_api_md_is_current() -> None:
    assert DOCS.read_text() == markdown(endpoints()), "run: python -m proxy.field_table > docs/api.md"


@pytest.mark.parametrize("route", list(CLIENT_TYPES))
def test_every_field_the_openai_client_sends_is_declared(route: str) -> None:
    sent = set(typing.get_type_hints(CLIENT_TYPES[route]))
    sent |= set() if route.endswith("count_tokens") else {"stream"}
    declared = {row.name for row in table(endpoints()[route])}
    assert sent <= declared, f"{route}: undeclared {sorted(sent - declared)}"


def test_the_openapi_document_carries_every_mark() -> None:
    schemas = document()["components"]["schemas"]
    for struct_type in endpoints().values():
        schema = schemas[struct_type.__name__]
        assert schema["additionalProperties"] is False
        for row in table(struct_type):
            shown = schema["properties"][row.name]
            assert shown.get("x-tether", HONOURED) == row.status, row.name


def _decode(route: str, extra: dict[str, object]) -> object:
    body = msgspec.json.encode(MINIMAL[route] | extra)
    return decode_body(body, endpoints()[route])


@pytest.mark.parametrize("route", list(MINIMAL))
def test_each_mark_does_what_it_says(route: str) -> None:
    rows = table(endpoints()[route])
    assert {r.status for r in rows} >= {HONOURED, NO_OP, REFUSED}
    for row in rows:
        if row.status == NO_OP:
            _decode(route, {row.name: row.example})
        elif row.status == REFUSED:
            with pytest.raises(ApiError) as info:
                _decode(route, {row.name: row.example})
            assert info.value.status == 400 and info.value.param == row.name, row.name
            assert info.value.code == "unsupported_parameter"
            assert "not supported" in info.value.message
            for value in row.allowed:
                _decode(route, {row.name: value})  # asks for nothing: accepted
            _decode(route, {row.name: None})


@pytest.mark.parametrize("route", list(MINIMAL))
def test_an_unknown_field_is_a_400_naming_it(route: str) -> None:
    with pytest.raises(ApiError) as info:
        _decode(route, {"frobnicate": 1})
    assert info.value.status == 400 and info.value.param == "frobnicate"
    assert info.value.code == "unknown_parameter"
    nested = NESTED.get(route, {"stream": True, "stream_options": {"frobnicate": 1}})
    with pytest.raises(ApiError) as info:
        _decode(route, nested)
    assert info.value.param is not None and info.value.param.endswith(".frobnicate")
