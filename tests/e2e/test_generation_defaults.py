"""A model's sampling defaults reach requests that omit them, end to end: a GGUF file stating
general.sampling.* keys, served by the real daemon and proxy; /health shows them, a request
that omits a field samples with the model's value, one that gives it keeps its own."""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import pytest

from tests.support.checkpoints import save_llama
from tests.support.gguf_files import write_gguf
from tests.support.pair import Server, start_server

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("sampled")

    def sampling(w: gguf.GGUFWriter) -> None:
        w.add_sampling_temp(0.25)
        w.add_sampling_top_p(0.5)
        w.add_sampling_top_k(7)

    path = write_gguf(tmp / "sampled.gguf", save_llama(tmp / "hf"), edit=sampling)
    server = start_server(tmp, ["--model", str(path)])
    yield server
    server.stop()


def test_health_shows_the_models_defaults(server: Server) -> None:
    with server.client() as c:
        health = c.get("/health").json()
    assert health["generation_defaults"] == {"temperature": 0.25, "top_p": 0.5, "top_k": 7}


def test_a_request_that_omits_them_takes_the_models(server: Server) -> None:
    """The Responses object says the temperature and top_p its output was sampled with."""
    with server.client() as c:
        omitted = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4}).json()
        given = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4,
                                              "temperature": 1.5, "top_p": 1.0}).json()
    assert (omitted["temperature"], omitted["top_p"]) == (0.25, 0.5)
    assert (given["temperature"], given["top_p"]) == (1.5, 1.0)
