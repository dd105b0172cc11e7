"""A request's own `num_speculative_tokens` (issue 38, per-request opt-out), through the official
openai client against a real pair started with --speculative-config: 0 turns speculation off for
that request (the spec_decode counters on /metrics do not move), a cap bounds its drafts, and a
value that is no count is a 400 naming the field, on each of the three surfaces."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from tests.support.metrics import m
from tests.support.pair import Server, start_server
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(180)

K = 4
SPECULATIVE = json.dumps({"method": "ngram", "num_speculative_tokens": K,
                          "prompt_lookup_max": 3, "prompt_lookup_min": 1})
# A prompt that repeats itself, and a greedy random model's answer loops: it drafts.
REPEATING = "one two three four " * 8
COUNTERS = ("tether_spec_decode_num_drafts_total", "tether_spec_decode_num_draft_tokens_total",
            "tether_spec_decode_num_accepted_tokens_total")
FINISHED = "tether_requests_finished_total"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("e2e-spec-requests"),
                     ["--max-num-seqs", "8", "--speculative-config", SPECULATIVE])
    yield s
    s.stop()


class Client:
    """The openai client, with the served model's name."""

    def __init__(self, server: Server) -> None:
        self.openai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                                    max_retries=0)
        self.model = self.openai.models.list().data[0].id


@pytest.fixture(scope="module")
def client(server: Server) -> Client:
    return Client(server)


def completion(client: Client, extra: dict[str, Any]) -> None:
    client.openai.completions.create(model=client.model, prompt=REPEATING, max_tokens=48,
                                     temperature=0, extra_body={"ignore_eos": True, **extra})


def chat(client: Client, extra: dict[str, Any]) -> None:
    client.openai.chat.completions.create(
        model=client.model, messages=[{"role": "user", "content": REPEATING}], max_tokens=48,
        temperature=0, extra_body={"ignore_eos": True, **extra})


def response(client: Client, extra: dict[str, Any]) -> None:
    client.openai.responses.create(model=client.model, input=REPEATING, max_output_tokens=48,
                                   temperature=0, store=False,
                                   extra_body={"ignore_eos": True, **extra})


SURFACES = [completion, chat, response]
Call = Callable[[Client, dict[str, Any]], None]


def moved(server: Server, call: Call, client: Client,
          extra: dict[str, Any]) -> tuple[float, ...]:
    """How far each spec_decode counter moves for one request (nothing else runs meanwhile),
    read from the daemon's Stats that count its end (they go out in the tick that ends it)."""
    before = server.metrics()
    call(client, extra)
    finished = m(before, FINISHED, reason="length") + 1
    wait_for(lambda: m(server.metrics(), FINISHED, reason="length") == finished, 5,
             "the daemon's Stats of the request's end")
    after = server.metrics()
    return tuple(m(after, name) - m(before, name) for name in COUNTERS)


@pytest.mark.parametrize("call", SURFACES, ids=lambda c: c.__name__)
def test_zero_turns_speculation_off_for_the_request(server: Server, client: Client,
                                                    call: Call) -> None:
    drafts, draft_tokens, accepted = moved(server, call, client, {})
    assert drafts > 0 and draft_tokens > 0 and accepted > 0  # it drafts when let
    assert moved(server, call, client, {"num_speculative_tokens": 0}) == (0, 0, 0)


@pytest.mark.parametrize("call", SURFACES, ids=lambda c: c.__name__)
def test_a_cap_bounds_the_drafts_and_one_above_the_servers_is_the_servers(
        server: Server, client: Client, call: Call) -> None:
    drafts, draft_tokens, _ = moved(server, call, client, {"num_speculative_tokens": 1})
    assert 0 < drafts and draft_tokens == drafts  # one draft token a step
    drafts, draft_tokens, accepted = moved(server, call, client, {"num_speculative_tokens": 99})
    assert 0 < accepted <= draft_tokens <= K * drafts and draft_tokens > drafts


@pytest.mark.parametrize("call", SURFACES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", [-1, 1.5, "2", True])
def test_a_value_that_is_no_count_is_a_400_naming_the_field(client: Client, call: Call,
                                                            value: object) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        call(client, {"num_speculative_tokens": value})
    error = raised.value
    # Refused for its value, not as an unknown field.
    assert (error.param, error.code) == ("num_speculative_tokens", "invalid_value"), error.body
    assert "num_speculative_tokens" in error.message
