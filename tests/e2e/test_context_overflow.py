"""A request too long for the model's context is refused naming the part that is too long: the
prompt (``prompt``, ``messages``, ``input``), the conversation a ``previous_response_id``
carries, or the room left for the output (``max_tokens``, ``max_output_tokens``)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.pair import Server

pytestmark = pytest.mark.timeout(120)

CONTEXT = 2048  # builtin:tiny's; its byte tokenizer makes one token of each ASCII character


def _refusal(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    with server.client() as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text[:300]
    error: dict[str, Any] = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and str(CONTEXT) in error["message"], error
    return error


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x" * 2100, "max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2100}],
                              "max_tokens": 4}, "messages"),
    ("/v1/responses", {"input": "x" * 2100, "max_output_tokens": 4}, "input"),
    ("/v1/completions", {"prompt": "x" * 1000, "max_tokens": 1500}, "max_tokens"),
    ("/v1/responses", {"input": "x" * 1000, "max_output_tokens": 1500}, "max_output_tokens"),
])
def test_the_part_that_is_too_long_is_named(server: Server, path: str, body: dict[str, Any],
                                            param: str) -> None:
    assert _refusal(server, path, body)["param"] == param


def test_a_chain_too_long_names_previous_response_id(server: Server) -> None:
    with server.client() as c:
        first = c.post("/v1/responses", json={"input": "x" * 1500, "max_output_tokens": 1})
    assert first.status_code == 200, first.text[:300]
    error = _refusal(server, "/v1/responses", {"input": "y" * 600, "max_output_tokens": 1,
                                               "previous_response_id": first.json()["id"]})
    assert error["param"] == "previous_response_id", error
