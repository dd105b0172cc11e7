"""tools, tool_choice and parallel_tool_calls in chat and Responses bodies: checked as OpenAI checks them,
resolved into what the output may be."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from ipc.records import ToolCallFormat, ToolFunction
from proxy.bodies import decode_body
from proxy.guides import MAX_GUIDE_BYTES
from proxy.http.errors import ApiError
from proxy.openai.schemas import ChatRequest
from proxy.openai.tool_requests import (
    CUSTOM_PARAMETERS,
    MAX_TOOLS,
    call_name,
    chat_tool_use,
    custom_input,
    resolve,
    tool_guide,
)
from proxy.responses.request import request_echo, tool_use
from tests.proxy.responses.test_input_items import _decoded

ASK = [{"role": "user", "content": "hi"}]
GET = {"type": "function", "function": {"name": "get", "description": "d", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}
PUT = {"type": "function", "function": {"name": "put"}}


def use_of(**body: Any) -> Any:
    req = decode_body(orjson.dumps({"messages": ASK, **body}), ChatRequest)
    return chat_tool_use(req.tools, req.tool_choice, req.parallel_tool_calls)


def refused(**body: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        use_of(**body)
    assert info.value.status == 400
    return info.value


def test_tools_resolve_to_what_the_output_may_be() -> None:
    auto = use_of(tools=[GET, PUT])
    assert auto.choice == "auto" and auto.parallel and not auto.forced
    # The parameters are the JSON text the client sent.
    assert auto.tools == (ToolFunction("get", "d", '{"type":"object","properties":'
                                                   '{"q":{"type":"string"}}}'),
                          ToolFunction("put"))
    required = use_of(tools=[GET, PUT], tool_choice="required", parallel_tool_calls=False)
    assert required.forced == required.tools and not required.parallel
    named = use_of(tools=[GET, PUT], tool_choice={"type": "function", "function": {"name": "put"}})
    assert [t.name for t in named.forced] == ["put"] and named.choice == "required"
    assert use_of(tools=[GET], tool_choice="none").parsed is False
    assert use_of() is None and use_of(tools=[], tool_choice="none") is None


def test_a_template_of_one_call_a_turn_is_asked_for_one() -> None:
    """Whatever parallel_tool_calls says, where the daemon's Welcome says the chat template
    takes one call a turn; a Response object echoes it as false."""
    for parallel in (None, True):
        req = decode_body(orjson.dumps({"messages": ASK, "tools": [GET],
                                        "parallel_tool_calls": parallel}), ChatRequest)
        assert not chat_tool_use(req.tools, "required", req.parallel_tool_calls, True).parallel
    body = orjson.dumps({"input": "hi", "tools": [R_GET], "parallel_tool_calls": True})
    decoded = _decoded(body, ("m",))
    assert not tool_use(decoded.req, single=True).parallel
    assert request_echo(decoded, single=True)["parallel_tool_calls"] is False
    assert request_echo(decoded)["parallel_tool_calls"] is True


def test_what_openai_refuses_is_a_400_naming_the_field() -> None:
    assert refused(tool_choice="required").param == "tool_choice"
    assert refused(tools=[GET], tool_choice={"type": "function",
                                             "function": {"name": "nope"}}).param == "tool_choice"
    assert refused(tools=[GET, GET]).param == "tools"
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": [1]}}
    assert refused(tools=[bad_schema]).param == "tools[0].function.parameters"
    bad_name = {"type": "function", "function": {"name": "has space"}}
    assert refused(tools=[bad_name]).param == "tools[0].function.name"
    assert refused(tools=[{"type": "web_search"}]).param == "tools[0].type"
    assert refused(tools=[GET], tool_choice="sometimes").param == "tool_choice"


def test_messages_with_tool_calls_and_tool_answers() -> None:
    body = {"messages": [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]}]}
    req = decode_body(orjson.dumps(body), ChatRequest)
    records = [m.to_record() for m in req.messages]
    assert records[1].content is None and records[1].tool_calls[0].name == "get"
    assert records[2].tool_call_id == "c1" and records[2].content == "42"


# --- the Responses API's spelling -------------------------------------------------------------

R_GET = {"type": "function", "name": "get", "parameters": GET["function"]["parameters"],
         "strict": True}


def responses_use_of(**body: Any) -> Any:
    req = _decoded(orjson.dumps({"input": "hi", **body}), ("m",)).req
    return tool_use(req)


def test_responses_function_tools_resolve_as_chat_tools_do() -> None:
    use = responses_use_of(tools=[R_GET, {"type": "function", "name": "put"}],
                           tool_choice={"type": "function", "name": "put"})
    assert [f.name for f in use.forced] == ["put"] and not use.parallel
    assert use.tools[0] == ToolFunction("get", None, orjson.dumps(R_GET["parameters"]).decode())
    assert responses_use_of(tools=[R_GET], parallel_tool_calls=False).parallel is False
    assert responses_use_of(tools=[R_GET], tool_choice="required").forced == use.tools[:1]
    assert responses_use_of() is None


def test_hosted_tools_are_accepted_and_never_offered() -> None:
    """As Codex CLI sends them: the functions are the model's tools, the hosted ones are echoed
    as sent (their own fields too) and run by nobody."""
    search = {"type": "web_search", "search_context_size": "low"}
    files = {"type": "file_search", "vector_store_ids": ["v"]}
    body = {"input": "hi", "tools": [search, R_GET, files]}
    decoded = _decoded(orjson.dumps(body), ("m",))
    use = tool_use(decoded.req)
    assert [f.name for f in use.tools] == ["get"] and use.choice == "auto"
    assert request_echo(decoded)["tools"] == [search, R_GET, files]
    assert responses_use_of(tools=[search, files]) is None
    assert responses_use_of(tools=[search], tool_choice="none") is None


def test_a_namespace_offers_its_functions_under_qualified_names() -> None:
    """As Codex CLI sends its sub-agent tools: each function is offered as
    <namespace>.<name>, with the namespace's description before its own; a call of one is an
    item naming the two apart."""
    spawn = {"type": "function", "name": "spawn", "description": "Start one.",
             "parameters": R_GET["parameters"]}
    group = {"type": "namespace", "name": "agents", "description": "Sub-agents.",
             "tools": [spawn, {"type": "function", "name": "get"}]}
    use = responses_use_of(tools=[R_GET, group, {"type": "web_search"}])
    assert [f.name for f in use.tools] == ["get", "agents.spawn", "agents.get"]
    assert use.tools[1].description == "Sub-agents.\n\nStart one."
    assert use.tools[1].parameters == orjson.dumps(R_GET["parameters"]).decode()
    assert responses_use_of(tools=[group], tool_choice="required").forced == use.tools[1:]
    assert call_name("agents.spawn") == {"name": "spawn", "namespace": "agents"}
    assert call_name("get") == {"name": "get"}


PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
         "format": {"type": "text"}}
LARK_PATCH = {**PATCH, "format": {"type": "grammar", "syntax": "lark",
                                  "definition": 'start: "*** Begin Patch"'}}


def test_a_custom_tool_is_a_function_of_its_one_string_input() -> None:
    """As Codex CLI sends its apply_patch: offered as a function taking the input as one string;
    its calls are custom_tool_call items (`custom`); a grammar format is told in the
    description, and a text one can be forced."""
    use = responses_use_of(tools=[R_GET, PATCH, {"type": "web_search"}])
    assert use.custom == {"apply_patch"} and use.choice == "auto"
    assert use.tools[1] == ToolFunction("apply_patch", "Edit files.", CUSTOM_PARAMETERS)
    assert orjson.loads(CUSTOM_PARAMETERS)["properties"] == {"input": {"type": "string"}}
    lark = responses_use_of(tools=[LARK_PATCH]).tools[0]
    assert lark.description == ('Edit files.\n\nThe input follows this lark grammar:\n'
                                'start: "*** Begin Patch"')
    forced = responses_use_of(tools=[R_GET, PATCH],
                              tool_choice={"type": "custom", "name": "apply_patch"})
    assert forced.forced == use.tools[1:2] and forced.custom == {"apply_patch"}
    assert responses_use_of(tools=[R_GET]).custom == frozenset()


@pytest.mark.parametrize(("arguments", "input"), [
    ('{"input": "a\\nb"}', "a\nb"),
    ('{"input": "cut sh', '{"input": "cut sh'),
    ('{"patch": "x"}', '{"patch": "x"}'),
])
def test_a_custom_calls_input_is_its_string_argument_or_what_was_written(
        arguments: str, input: str) -> None:
    assert custom_input(arguments) == input


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": [{"type": "calculator", "name": "c"}]}, "tools[0].type", "'calculator'"),
    ({"tools": [R_GET, {"type": "namespace", "name": "n", "tools": []}]}, "tools[1].tools",
     "at least one function"),
    ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}]},
     "tools[0].tools[0].type", "'web_search'"),
    ({"tools": [{"type": "namespace", "tools": [R_GET]}]}, "tools[0].name", "missing"),
    ({"tools": [{"type": "namespace", "name": "n.m", "tools": [R_GET]}]}, "tools[0].name", ""),
    # Forcing a hosted tool is the one thing about it that is refused.
    ({"tools": [R_GET], "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type",
     "hosted tool 'web_search_preview'"),
    ({"tools": [{"type": "web_search"}, {"type": "mcp", "server_label": "s"}],
      "tool_choice": "required"}, "tool_choice", "hosted tools (mcp, web_search)"),
    ({"tools": [R_GET], "tool_choice": {"type": "calculator", "name": "c"}}, "tool_choice.type",
     "'calculator'"),
    ({"tools": [R_GET], "tool_choice": {"type": "custom", "name": "patch"}}, "tool_choice",
     "'patch'"),
    # A forced custom tool's grammar cannot be enforced inside the call: refused, not ignored.
    ({"tools": [R_GET, LARK_PATCH], "tool_choice": {"type": "custom", "name": "apply_patch"}},
     "tools[1].format", "grammar"),
    ({"tools": [LARK_PATCH], "tool_choice": "required"}, "tools[0].format", "grammar"),
    ({"tools": [{"type": "custom", "name": "p", "format": {"type": "grammar"}}]},
     "tools[0].format", "'syntax' and 'definition'"),
    ({"tools": [{"type": "custom"}]}, "tools[0].name", "missing"),
    ({"tools": [{"type": "function"}]}, "tools[0].name", "missing"),
    ({"tools": [R_GET], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed"),
])
def test_responses_tools_refused_are_a_400_naming_the_field(
        body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(ApiError) as info:
        responses_use_of(**body)
    assert (info.value.status, info.value.param) == (400, param)
    assert words in info.value.message


# --- what a request's tools may cost (issue 34, item 11) ---------------------------------------


def _functions(count: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(count)]


def test_more_tools_than_openai_allows_are_a_400_naming_the_limit() -> None:
    assert len(use_of(tools=_functions(MAX_TOOLS)).tools) == MAX_TOOLS == 128
    e = refused(tools=_functions(MAX_TOOLS + 1))
    assert e.param == "tools" and f"{MAX_TOOLS + 1} tools" in e.message
    assert str(MAX_TOOLS) in e.message and e.code == "array_above_max_length"
    # On Responses a namespace's functions count one each, and so do hosted tools.
    members = [{"type": "function", "name": f"f{i}"} for i in range(MAX_TOOLS)]
    group = {"type": "namespace", "name": "n", "tools": members}
    assert len(responses_use_of(tools=[group]).tools) == MAX_TOOLS
    for tools in ([group, R_GET], [group, {"type": "web_search"}]):
        with pytest.raises(ApiError) as info:
            responses_use_of(tools=tools)
        assert info.value.param == "tools" and str(MAX_TOOLS) in info.value.message


def test_parameters_over_a_guides_limit_are_a_400_naming_them() -> None:
    fits = {"type": "object", "description": "x" * (MAX_GUIDE_BYTES - 100)}
    over = {"type": "object", "description": "x" * MAX_GUIDE_BYTES}
    assert use_of(tools=[{"type": "function", "function": {"name": "f", "parameters": fits}}])
    e = refused(tools=[PUT, {"type": "function", "function": {"name": "f", "parameters": over}}])
    assert e.param == "tools[1].function.parameters" and str(MAX_GUIDE_BYTES) in e.message
    with pytest.raises(ApiError) as info:
        responses_use_of(tools=[{"type": "function", "name": "f", "parameters": over}])
    assert info.value.param == "tools[0].parameters"


def test_the_grammar_of_forced_calls_is_bounded_as_a_guide() -> None:
    """Each function within its limit, together more than one grammar may be: refused before
    any of it is built (the daemon's compile would refuse it seconds later)."""
    third = {"type": "object", "description": "x" * (MAX_GUIDE_BYTES // 3)}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": third}}
             for i in range(4)]
    use = use_of(tools=tools, tool_choice="required")
    with pytest.raises(ApiError) as info:
        tool_guide(use, ToolCallFormat.HERMES, None)
    assert info.value.param == "tools" and str(MAX_GUIDE_BYTES) in info.value.message
    named = use_of(tools=tools, tool_choice={"type": "function", "function": {"name": "f2"}})
    assert tool_guide(named, ToolCallFormat.HERMES, None) is not None  # one of them fits
    assert tool_guide(use_of(tools=tools), ToolCallFormat.HERMES, None) is None  # auto: none


def test_names_are_checked_in_linear_time() -> None:
    """60,000 functions (a body of them is under the size limit): each name looked up once,
    not against every name before it (minutes, on the proxy's loop)."""
    functions = [ToolFunction(f"f{i}") for i in range(60_000)]
    t0 = time.monotonic()
    assert resolve(functions, None, None, None, "tools") is not None
    with pytest.raises(ApiError, match="'f0' twice"):
        resolve([*functions, ToolFunction("f0")], None, None, None, "tools")
    assert time.monotonic() - t0 < 5.0  # ~0.05 s here; the quadratic check took minutes
