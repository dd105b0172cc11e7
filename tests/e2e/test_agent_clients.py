"""Real agent frameworks against the real pair: the OpenAI Agents SDK runs an agent with a function
tool and an output_type over both its Responses and its Chat Completions models; LangChain's
ChatOpenAI binds tools and asks for structured output by each of its three methods.

builtin:tiny has random weights, so nothing here may depend on what it chooses: a call is forced
(tool_choice required or named), and what is asked of the output is a grammar's to guarantee."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import jsonschema
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunContextWrapper,
    Runner,
    WebSearchTool,
    function_tool,
    set_tracing_disabled,
)
from agents.items import ToolCallItem
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from pydantic import BaseModel, Field, ValidationError

from tests.e2e.test_chat_tools import MODEL
from tests.support.pair import Server

pytestmark = pytest.mark.timeout(240)


class Report(BaseModel):
    """The agent's answer: bounded, so that it closes well within the budget."""

    city: str = Field(max_length=12)
    warm: bool
    unit: Literal["celsius", "fahrenheit"]


def _agent(server: Server, api: str, ran: list[str], model_name: str = MODEL) -> Agent[Any]:
    """An agent whose tool is forced on its first turn and offered only until it has run: after
    a call the SDK resets tool_choice to auto (reset_tool_choice), and random weights choosing
    freely between another call and the answer could call until the context is full."""

    def not_yet_run(ctx: RunContextWrapper[Any], agent: Any) -> bool:
        return not ran

    @function_tool(is_enabled=not_yet_run)
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        ran.append(city)
        return "sunny, 21C"

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model: Any = (OpenAIResponsesModel(model_name, client) if api == "responses"
                  else OpenAIChatCompletionsModel(model_name, client))
    # Hosted tools are accepted and never offered on Responses; the SDK refuses them on chat.
    hosted = [WebSearchTool()] if api == "responses" else []
    return Agent(name="weather", instructions="Look the weather up, then report it.",
                 tools=[get_weather, *hosted], output_type=Report, model=model,
                 model_settings=ModelSettings(tool_choice="required", max_tokens=200))


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "streamed"])
@pytest.mark.parametrize("api", ["responses", "chat"])
def test_the_agents_sdk_runs_a_tool_then_answers_its_output_type(
        server: Server, api: str, streamed: bool) -> None:
    set_tracing_disabled(True)
    ran: list[str] = []
    agent = _agent(server, api, ran)

    async def run() -> Any:
        if not streamed:
            return await Runner.run(agent, "Weather in Paris?", max_turns=4)
        result = Runner.run_streamed(agent, "Weather in Paris?", max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    calls = [item for item in result.new_items if isinstance(item, ToolCallItem)]
    # The SDK checks each call's arguments against the tool's schema and, when they fail, answers
    # the model with the error instead of running the function: every call ran.
    assert calls and len(ran) == len(calls)
    assert isinstance(result.final_output, Report)
    assert len(result.raw_responses) == 2


# --- LangChain --------------------------------------------------------------------------------


@tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """The weather now in a city."""
    return "sunny"


@pytest.fixture
def chat(server: Server) -> ChatOpenAI:
    return ChatOpenAI(base_url=server.url + "/v1", api_key="unused",  # type: ignore[arg-type]
                      model=MODEL, max_retries=0, max_tokens=200)  # type: ignore[call-arg]


@pytest.mark.parametrize("strict", [None, True])
@pytest.mark.parametrize("choice", ["required", "get_weather", "any"])
def test_langchain_bind_tools_calls_with_valid_arguments(chat: ChatOpenAI, choice: str,
                                                         strict: bool | None) -> None:
    """"any" is LangChain's word for required; a name forces that tool. The arguments validate
    against the parameters LangChain sent (extra properties allowed unless strict)."""
    bound = chat.bind_tools([get_weather], tool_choice=choice, strict=strict)
    sent = convert_to_openai_tool(get_weather, strict=strict)["function"]["parameters"]
    for _ in range(3):
        message = bound.invoke("Weather in Paris?", temperature=1.0)
        assert isinstance(message, AIMessage) and message.tool_calls
        assert not message.invalid_tool_calls
        for call in message.tool_calls:
            assert call["name"] == "get_weather" and call["id"]
            jsonschema.validate(call["args"], sent)
            get_weather.args_schema.model_validate(call["args"])  # type: ignore[union-attr]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_by_schema(chat: ChatOpenAI, method: str) -> None:
    """Both send Report's schema (a response format, or a function forced by name): the grammar
    makes the output an instance, whatever the weights."""
    structured = chat.with_structured_output(Report, method=method)  # type: ignore[arg-type]
    for _ in range(3):
        assert isinstance(structured.invoke("Weather in Paris?", temperature=1.0), Report)


def test_langchain_json_mode_is_a_json_object(chat: ChatOpenAI) -> None:
    """json_mode sends only {"type": "json_object"}: Report's fields are in no request, so no
    grammar can force them and only a model that follows the prompt fills them. What the server
    owes is a JSON object, which LangChain parses and then checks against Report."""
    structured = chat.with_structured_output(Report, method="json_mode", include_raw=True)
    for _ in range(3):
        answer = structured.invoke("Report the weather in Paris as a JSON object.",
                                   temperature=1.0)
        assert isinstance(answer, dict)
        assert isinstance(json.loads(answer["raw"].content), dict)
        parsed, error = answer["parsed"], answer["parsing_error"]
        assert isinstance(parsed, Report) or isinstance(error.__cause__, ValidationError)
