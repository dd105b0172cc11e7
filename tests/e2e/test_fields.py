"""The field table walked through a real pair with the official openai client: each no-op field
answers 200, each refused one a 400 naming it, an unknown one a 400; none leaves a session
behind."""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from proxy.field_table import endpoints
from proxy.fields import NO_OP, REFUSED, table
from tests.support.pair import Server, assert_baseline

# What each route's call takes as keywords; the rest (vLLM's extensions) goes in extra_body.
KEYWORDS = {route: set(typing.get_type_hints(params)) for route, params in [
    ("/v1/completions", completion_create_params.CompletionCreateParamsBase),
    ("/v1/chat/completions", chat_create_params.CompletionCreateParamsBase),
    ("/v1/responses", response_create_params.ResponseCreateParamsBase)]}


def _field(route: str, name: str, value: Any) -> dict[str, Any]:
    return {name: value} if name in KEYWORDS[route] else {"extra_body": {name: value}}


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _senders(client: openai.OpenAI) -> dict[str, Callable[..., Any]]:
    """Each route's call, asking for two tokens, with the fields under test on top."""
    model = client.models.list().data[0].id

    def completions(**fields: Any) -> Any:
        return client.completions.create(model=model, prompt="hi", max_tokens=2, **fields)

    def chat(**fields: Any) -> Any:
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **fields)

    def responses(**fields: Any) -> Any:
        return client.responses.create(model=model, input="hi", max_output_tokens=2, **fields)

    return {"/v1/completions": completions, "/v1/chat/completions": chat,
            "/v1/responses": responses}


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_the_table_through_the_openai_client(server: Server, client: openai.OpenAI,
                                             route: str) -> None:
    send = _senders(client)[route]
    for row in table(endpoints()[route]):
        if row.status == NO_OP:
            send(**_field(route, row.name, row.example))
        elif row.status == REFUSED:
            with pytest.raises(openai.BadRequestError) as info:
                send(**_field(route, row.name, row.example))
            assert info.value.status_code == 400
            assert isinstance(info.value.body, dict) and info.value.body["param"] == row.name
    with pytest.raises(openai.BadRequestError) as info:
        send(extra_body={"frobnicate": 1})
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "frobnicate"
    assert info.value.body["code"] == "unknown_parameter"
    assert_baseline(server.metrics())
