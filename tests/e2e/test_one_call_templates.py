"""A chat template that takes one tool call a turn gets one (issue 34, item 2). Llama 3.1's raises
"This model only supports single tool-calls at once!" for an assistant turn of several, so a
turn of two could never be sent back: agent loops failed on their second request. The daemon
finds that by rendering a turn of one call and one of two (its Welcome says so), and the proxy
asks for one call whatever `parallel_tool_calls` says: the grammar of a forced call, the parser,
and the Response object's echo.

The checkpoint is a random Llama 3 (the real tokenizer and Llama 3.1's template); random weights
decide nothing here: a forced call's grammar writes it, and an agent's output type is a strict
response format."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from agents import Runner, set_tracing_disabled
from agents.items import ToolCallItem

from tests.e2e.test_agent_clients import Report, _agent
from tests.support.pair import Server, start_server
from tests.support.real_tokenizers import save_random_checkpoint

pytestmark = pytest.mark.timeout(300)

NAME = "llama31-ckpt"  # the checkpoint's directory: the model name the pair serves
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
           "required": ["city"]}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}}}}]
ASK: list[Any] = [{"role": "user", "content": "Weather and time in Paris?"}]
SEEDS = range(8)  # before, 6 of 8 seeds made two to four calls


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    checkpoint = save_random_checkpoint("llama3", tmp_path_factory.mktemp("ckpt") / NAME,
                                        max_len=2048, end_scale=5.0)
    s = start_server(tmp_path_factory.mktemp("one-call"),
                     ["--model", str(checkpoint), "--max-num-seqs", "4"])
    yield s
    s.stop()


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_required_is_one_call_and_the_turn_goes_back(client: openai.OpenAI,
                                                     server: Server) -> None:
    for seed in SEEDS:
        stream = seed % 2 == 1
        body: dict[str, Any] = {"model": NAME, "messages": ASK, "tools": TOOLS, "seed": seed,
                                "tool_choice": "required", "max_tokens": 160,
                                "temperature": 1.0, "parallel_tool_calls": True}
        if stream:
            with client.chat.completions.stream(**body) as events:
                message = events.get_final_completion().choices[0].message
        else:
            message = client.chat.completions.create(**body).choices[0].message
        calls = message.tool_calls or []
        assert len(calls) == 1, (seed, calls)
        json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
        # The turn back, with the tool's answer: the template renders it (before: a 400).
        history = [*ASK, message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]
        r = client.chat.completions.with_raw_response.create(
            model=NAME, messages=history, tools=TOOLS, max_tokens=4)
        assert r.status_code == 200
    assert "one tool call a turn" in server.log("daemon")


def test_responses_say_one_call_in_their_echo(client: openai.OpenAI) -> None:
    tools: list[Any] = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    for _ in range(2):
        r = client.responses.create(model=NAME, input="Weather in Paris?", tools=tools,
                                    tool_choice="required", max_output_tokens=120)
        calls = [item for item in r.output if item.type == "function_call"]
        assert len(calls) == 1 and r.parallel_tool_calls is False
        fetched = client.responses.retrieve(r.id)  # parsed again from the store: the same
        assert [i.type for i in fetched.output] == [i.type for i in r.output]


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_an_agents_sdk_loop_completes_over_the_template(server: Server, api: str) -> None:
    """The SDK's default settings (parallel_tool_calls left to the server): it runs the call,
    sends the turn back and gets its output type. Before, chat's seed 6 made two calls and the
    turn back was a 400, as were 2 of 8 unseeded runs on Responses (which takes no seed)."""
    set_tracing_disabled(True)
    for seed in (6, 7, 8, 9):
        ran: list[str] = []
        agent = _agent(server, api, ran, NAME)
        if api == "chat":
            agent.model_settings = dataclasses.replace(agent.model_settings,
                                                       extra_args={"seed": seed})
        result = asyncio.run(Runner.run(agent, "Weather in Paris?", max_turns=4))
        calls = [item for item in result.new_items if isinstance(item, ToolCallItem)]
        assert len(calls) == len(ran) == 1
        assert isinstance(result.final_output, Report)
