"""The names a client sees, through the openai client: --served-model-name (vLLM's flag) in
/v1/models, in `GET /v1/models/{id}` and as the `model` it sends and gets back; the release in
/health."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

import tether
from tests.support.pair import Server, start_server

NAME = "team/demo-7b"  # a slash, as a hub id has: the client sends it as %2F


@pytest.fixture(scope="module")
def named(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("named"),
                          ["--model", "sim:5", "--served-model-name", NAME])
    yield server
    server.stop()


@pytest.fixture
def client(named: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=named.url + "/v1", api_key="unused", max_retries=0)


def test_the_served_name_is_the_id_clients_see_and_send(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    card = client.models.retrieve(NAME)
    assert (card.id, card.object, card.owned_by) == (NAME, "model", "tether")
    assert card.created > 0
    answer = client.completions.create(model=NAME, prompt="hi", max_tokens=2)
    assert answer.model == NAME and answer.choices[0].finish_reason == "length"


@pytest.mark.parametrize("unknown", ["sim:5", "nope", "team/other"])
def test_another_name_is_a_404_as_openai_answers_it(client: openai.OpenAI, unknown: str) -> None:
    """--model's spec is no longer a name the server answers to once another is given."""
    for call in (lambda: client.models.retrieve(unknown),
                 lambda: client.completions.create(model=unknown, prompt="hi", max_tokens=2)):
        with pytest.raises(openai.NotFoundError) as refused:
            call()
        assert refused.value.code == "model_not_found"
        assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "model"
        assert unknown in refused.value.body["message"]


def test_health_says_the_release(named: Server) -> None:
    body = httpx.get(named.url + "/health", timeout=10.0).json()
    assert body["status"] == "ok" and body["version"] == tether.__version__
    assert body["model"] == NAME
