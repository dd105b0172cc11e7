"""What requests say about tools, as the chat and Responses bodies spell it, and the `ToolUse` it
resolves to (proxy/tool_calls/): the functions offered, ``tool_choice`` and
``parallel_tool_calls``, checked as OpenAI checks them. On /v1/responses a ``namespace`` tool is
its functions, offered under qualified names; a ``custom`` tool (free text in, as Codex CLI's
apply_patch) is offered as a function of one string; OpenAI's hosted tools (web_search,
file_search, ...) are accepted and passed over: this server runs none of them.

A function's ``parameters`` stay the JSON text the client sent (msgspec.Raw: never built into
Python objects here); they travel to the daemon as that text, which renders them in the chat
template, and into the grammar of a forced call.

What a request's tools cost the proxy's loop (their checks here, a forced call's grammar) and the
daemon (the template's prompt, the grammar's compile) is bounded whatever the body's size: at
most MAX_TOOLS tools, each function's parameters at most MAX_GUIDE_BYTES, as a response
format's schema, and as much together for the functions a grammar holds
(proxy/tool_calls/grammar.py); the checks are linear in the tools.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec

from ipc.records import Guide, ToolCallFormat, ToolFunction
from proxy.guides import MAX_GUIDE_BYTES
from proxy.http.errors import ApiError
from proxy.tool_calls import ToolGrammarError, ToolUse

# OpenAI's limit on a request's tools ("a max of 128 functions are supported"), which every
# client written for it keeps; a namespace's functions count one each.
MAX_TOOLS = 128

# What docs/api.md says of the fields (proxy/fields.py's `honoured`).
TOOLS_NOTE = (
    f"at most {MAX_TOOLS} (a namespace's functions count one each), each function's "
    f"`parameters` at most {MAX_GUIDE_BYTES} bytes, and those of the functions a grammar holds "
    "(a forced call's, or calls beside a response format) as much together: 400 above; a "
    "call's arguments follow its `parameters`, whose objects take only the properties they "
    "list unless they say `additionalProperties` (OpenAI's strict reading, `strict` or not)")
PARALLEL_NOTE = (
    "where the model's chat template takes one call a turn (Llama 3.1 to 3.3's raise for "
    "more), a turn holds one call whatever this says, and a Response object echoes `false`")

# OpenAI's rule for function names (and so a safe word in a grammar).
FunctionName = Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDefinition(msgspec.Struct):
    name: FunctionName
    description: str | None = None
    parameters: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET  # a JSON schema
    strict: bool | None = None


class ChatTool(msgspec.Struct):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class FunctionChoice(msgspec.Struct):
    name: str


class ChatNamedChoice(msgspec.Struct):
    function: FunctionChoice
    type: Literal["function"] = "function"


ChoiceWord = Literal["none", "auto", "required"]
ChatToolChoice = ChoiceWord | ChatNamedChoice


def tool_function(name: str, description: str | None, parameters: msgspec.Raw | msgspec.UnsetType,
                  param: str) -> ToolFunction:
    """The record of one function; `param` names its ``parameters`` in errors."""
    if parameters is msgspec.UNSET:
        return ToolFunction(name, description)
    if len(parameters) > MAX_GUIDE_BYTES:
        raise ApiError(400, f"'{param}' is {len(parameters)} bytes, more than the server's limit "
                       f"of {MAX_GUIDE_BYTES}", param=param, code="invalid_value")
    text = bytes(parameters).decode()
    if text.strip() == "null":
        return ToolFunction(name, description)
    if not text.lstrip().startswith("{"):
        raise ApiError(400, f"'{param}' must be a JSON schema object", param=param,
                       code="invalid_value")
    return ToolFunction(name, description, text)


def resolve(functions: Sequence[ToolFunction], choice: ChoiceWord | None, named: str | None,
            parallel: bool | None, param: str, single: bool = False) -> ToolUse | None:
    """The request's ToolUse (None: no tools); `named` is a named choice's function, `param`
    names ``tools`` as the endpoint spells its functions' place; `single`: the chat template
    takes one call a turn, so one is all a turn may hold, whatever `parallel` says."""
    seen: set[str] = set()
    for function in functions:
        if function.name in seen:
            raise ApiError(400, f"'{param}' names the function '{function.name}' twice",
                           param=param, code="invalid_value")
        seen.add(function.name)
    if not functions:
        if named is not None or choice == "required":
            raise ApiError(400, "'tool_choice' is only allowed when 'tools' are specified",
                           param="tool_choice", code="invalid_value")
        return None
    tools = tuple(functions)
    if named is not None:
        forced = tuple(f for f in functions if f.name == named)
        if not forced:
            raise ApiError(400, f"'tool_choice' names the function '{named}', which is not in "
                           f"'{param}'", param="tool_choice", code="invalid_value")
        return ToolUse(tools, "required", forced, parallel=False)
    word = choice or "auto"
    return ToolUse(tools, word, tools if word == "required" else (),
                   parallel is not False and not single)


def check_count(count: int, param: str) -> None:
    """A 400 naming `param` when a request offers more than MAX_TOOLS tools."""
    if count > MAX_TOOLS:
        raise ApiError(400, f"'{param}' holds {count} tools, more than the server's limit of "
                       f"{MAX_TOOLS} (a namespace's functions count one each)", param=param,
                       code="array_above_max_length")


def chat_tool_use(tools: list[ChatTool] | None, choice: ChatToolChoice | None,
                  parallel: bool | None, single: bool = False) -> ToolUse | None:
    check_count(len(tools or ()), "tools")
    functions = [tool_function(t.function.name, t.function.description, t.function.parameters,
                               f"tools[{i}].function.parameters")
                 for i, t in enumerate(tools or [])]
    named = choice.function.name if isinstance(choice, ChatNamedChoice) else None
    word = None if isinstance(choice, ChatNamedChoice) else choice
    return resolve(functions, word, named, parallel, "tools", single)


def tool_guide(use: ToolUse, fmt: ToolCallFormat, content: Guide | None) -> Guide | None:
    """The output's constraint: forced calls, calls or `content` (a response format's), or
    `content` alone; a 400 naming ``tools`` when they cannot be combined."""
    try:
        return use.guide(fmt, content)
    except ToolGrammarError as e:
        raise ApiError(400, f"'tools' cannot be used here: {e}", param="tools",
                       code="invalid_value") from None


# OpenAI's built-in tools: their calls are items only OpenAI's models write, and OpenAI (or, for a
# shell or a computer, its own client) runs them. Clients such as Codex CLI send them on every
# request, so they are accepted and never offered to the model; only forcing one is refused.
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
    "file_search", "code_interpreter", "image_generation", "mcp", "computer",
    "computer_use_preview", "local_shell", "shell", "apply_patch", "tool_search",
    "programmatic_tool_calling"})


class CustomFormat(msgspec.Struct):
    """A custom tool's input: free ``text``, or a ``grammar`` (Lark or a regex) it follows."""

    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


class ResponsesTool(msgspec.Struct):
    """A Responses tool: ``function`` tools, ``namespace`` groups of them and ``custom`` tools are
    served and hosted ones passed over (the type is checked by `responses_tool_use`, so that any
    other is refused by its name)."""

    type: str
    name: FunctionName | None = None
    description: str | None = None
    parameters: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    strict: bool | None = None
    tools: list[ResponsesTool] | None = None  # a namespace's functions
    format: CustomFormat | None = None  # a custom tool's


class ResponsesNamedChoice(msgspec.Struct):
    type: str
    name: str | None = None


# A namespace's function is offered to the model, and so written in its calls, under its name
# qualified by the namespace's: a function's own name never holds the dot, so the qualified name
# is never another function's, and a call item carries the two apart, as OpenAI's do.
NAMESPACE_SEP = "."


def qualified(namespace: str | None, name: str) -> str:
    return name if namespace is None else f"{namespace}{NAMESPACE_SEP}{name}"


def call_name(model_name: str) -> dict[str, str]:
    """A call item's ``name`` (and ``namespace``, for a namespace's function) of the name the
    model wrote."""
    namespace, dot, name = model_name.rpartition(NAMESPACE_SEP)
    return {"name": name, "namespace": namespace} if dot else {"name": model_name}


ResponsesToolChoice = ChoiceWord | ResponsesNamedChoice


# Chat templates and the call formats know functions only, so a custom tool is offered as a
# function taking its free input as one string argument: the model writes a call as it writes any
# other, the input is that argument's string, and a forced call's grammar is the calls' own.
CUSTOM_INPUT = "input"
CUSTOM_PARAMETERS = msgspec.json.encode({
    "type": "object", "properties": {CUSTOM_INPUT: {"type": "string"}},
    "required": [CUSTOM_INPUT], "additionalProperties": False}).decode()


def custom_input(arguments: str) -> str:
    """A custom tool's input, of the arguments the model wrote for its call (as written when they
    are not the one string: a call cut short, or a model that wrote other arguments)."""
    try:
        decoded = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return arguments
    if isinstance(decoded, dict) and list(decoded) == [CUSTOM_INPUT] and isinstance(
            decoded[CUSTOM_INPUT], str):
        return decoded[CUSTOM_INPUT]
    return arguments


def responses_tool_use(tools: list[ResponsesTool] | None, choice: ResponsesToolChoice | None,
                       parallel: bool | None, single: bool = False) -> ToolUse | None:
    check_count(sum(len(t.tools or ()) if t.type == "namespace" else 1 for t in tools or ()),
                "tools")
    functions: list[ToolFunction] = []
    hosted = []
    grammars: dict[str, str] = {}  # custom tools with a grammar format: where it is
    for i, tool in enumerate(tools or []):
        if tool.type in HOSTED_TOOLS:
            hosted.append(tool.type)
        elif tool.type == "namespace":
            functions += _namespace_functions(tool, f"tools[{i}]")
        elif tool.type == "custom":
            functions.append(_custom(tool, f"tools[{i}]"))
            if tool.format is not None and tool.format.type == "grammar":
                grammars[functions[-1].name] = f"tools[{i}].format"
        else:
            functions.append(_function(tool, None, f"tools[{i}]"))
    use = resolve(functions, *_choice(choice, hosted, functions), parallel, "tools", single)
    if use is None:
        return None
    where = next((grammars[f.name] for f in use.forced if f.name in grammars), None)
    if where is not None:
        # Its input would have to follow the grammar inside the call's JSON string, which the
        # call grammar cannot say: refused rather than forced with the format ignored.
        raise ApiError(400, f"'tool_choice' forces a custom tool whose '{where}' is a grammar, "
                       "which this server cannot enforce inside a call; force it with a 'text' "
                       "format, or leave the choice 'auto'", param=where, code="invalid_value")
    custom = frozenset(t.name for t in tools or [] if t.type == "custom" and t.name)
    return dataclasses.replace(use, custom=custom) if custom else use


def _choice(choice: ResponsesToolChoice | None, hosted: list[str],
            functions: list[ToolFunction]) -> tuple[ChoiceWord | None, str | None]:
    """The choice's word and named function."""
    named = None
    if isinstance(choice, ResponsesNamedChoice):
        if choice.type in HOSTED_TOOLS:
            raise _forced_hosted(f"the hosted tool '{choice.type}'", "tool_choice.type")
        if choice.type not in ("function", "custom"):
            raise _unsupported_type(choice.type, "tool_choice.type")
        if choice.name is None:
            raise ApiError(400, "missing required field 'tool_choice.name'",
                           param="tool_choice.name", code="missing_required_parameter")
        named = choice.name
    elif choice == "required" and hosted and not functions:
        raise _forced_hosted(f"a call of the hosted tools ({', '.join(sorted(set(hosted)))})",
                             "tool_choice")
    return (None if isinstance(choice, ResponsesNamedChoice) else choice), named


def _custom(tool: ResponsesTool, where: str) -> ToolFunction:
    """A custom tool's function; a grammar format is told the model in its description."""
    if tool.name is None:
        raise ApiError(400, f"missing required field '{where}.name'", param=f"{where}.name",
                       code="missing_required_parameter")
    fmt, description = tool.format, tool.description
    if fmt is not None and fmt.type == "grammar":
        if fmt.syntax is None or not fmt.definition:
            raise ApiError(400, f"a grammar '{where}.format' needs its 'syntax' and "
                           "'definition'", param=f"{where}.format", code="invalid_value")
        told = f"The {CUSTOM_INPUT} follows this {fmt.syntax} grammar:\n{fmt.definition}"
        description = "\n\n".join(d for d in (description, told) if d)
    return ToolFunction(tool.name, description, CUSTOM_PARAMETERS)


def _function(tool: ResponsesTool, namespace: ResponsesTool | None, where: str) -> ToolFunction:
    """A function tool's record; `namespace` the group it is one of, whose description the
    model reads with it."""
    if tool.type != "function":
        raise _unsupported_type(tool.type, f"{where}.type")
    if tool.name is None:
        raise ApiError(400, f"missing required field '{where}.name'", param=f"{where}.name",
                       code="missing_required_parameter")
    if namespace is None:
        return tool_function(tool.name, tool.description, tool.parameters, f"{where}.parameters")
    description = "\n\n".join(d for d in (namespace.description, tool.description) if d)
    return tool_function(qualified(namespace.name, tool.name), description or None,
                         tool.parameters, f"{where}.parameters")


def _namespace_functions(tool: ResponsesTool, where: str) -> list[ToolFunction]:
    if tool.name is None:
        raise ApiError(400, f"missing required field '{where}.name'", param=f"{where}.name",
                       code="missing_required_parameter")
    if not tool.tools:
        raise ApiError(400, f"'{where}.tools' must name at least one function",
                       param=f"{where}.tools", code="invalid_value")
    return [_function(member, tool, f"{where}.tools[{j}]") for j, member in enumerate(tool.tools)]


def _forced_hosted(what: str, param: str) -> ApiError:
    return ApiError(400, f"'tool_choice' forces {what}, which this server does not run: "
                    "hosted tools are accepted in 'tools' but never offered to the model",
                    param=param, code="invalid_value")


def _unsupported_type(kind: str, param: str) -> ApiError:
    kind = kind if len(kind) <= 64 else kind[:64] + "..."
    return ApiError(400, f"tool type '{kind}' is not supported: only 'function', 'namespace' and "
                    "'custom' tools (and hosted tools, never offered to the model) are", param=param,
                    code="invalid_value")
