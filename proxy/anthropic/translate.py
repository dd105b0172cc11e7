"""A Messages request as the engine's chat Submit: the edge between Anthropic's shapes and the
chat path, which then serves it as it serves /v1/chat/completions (the same exchange, tool-call
parsing, forced-call grammars and drop guarantees).

- ``system`` (a string or text blocks) is the first system message, and a ``system``-role
  message inside ``messages`` (Claude Code's environment) joins it, in order.
- A user turn's ``tool_result`` blocks are tool messages answering their ``tool_use_id`` (an
  ``is_error`` one says so first), in the order given; its text blocks are the user message
  after them. An assistant turn's ``tool_use`` blocks are its tool calls, ``input`` as the
  arguments' JSON text. Earlier thinking blocks are left out, as Anthropic leaves them out.
- ``image`` and ``document`` blocks are a 400 naming the block: only text is read.
- ``tools`` are the functions offered (``input_schema`` as ``parameters``), but for those with
  ``defer_loading``; ``tool_choice`` ``auto``/``any``/``tool``/``none`` are chat's ``auto``/
  ``required``/named/``none``, forced by the same grammar, so a forced call's ``input`` always
  validates; ``disable_parallel_tool_use`` is chat's ``parallel_tool_calls: false``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import msgspec

from ipc.records import GenerationDefaults, Message, SamplingParams, ToolCall, ToolFunction
from proxy.anthropic.request import (
    NO_REASONING,
    MessageParam,
    MessagesRequest,
    RefusedBlock,
    ResultPart,
    TextBlock,
    Tool,
    ToolChoice,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolUseBlock,
    _Prompt,
)
from proxy.guides import strict_schema_guide
from proxy.http.errors import ApiError
from proxy.openai.schemas import model_sampling
from proxy.openai.tool_requests import check_count, resolve, tool_function
from proxy.tool_calls import ToolUse

ERROR_RESULT = "Error: "  # before the text of a tool_result with is_error


def chat_messages(req: _Prompt) -> list[Message]:
    """The request's system prompt and messages as the chat template's messages: one system
    message first, of `system` and then each system-role message, since chat templates take a
    system message first only (Mistral's refuse a later one)."""
    system = req.system
    systems = [system] if isinstance(system, str) else [block.text for block in system or ()]
    out: list[Message] = []
    for i, message in enumerate(req.messages):
        turn = _turn(message, f"messages[{i}].content")
        if message.role == "system":
            systems += [m.content for m in turn if m.content]
        else:
            out += turn
    text = "\n\n".join(s for s in systems if s)
    return [Message("system", text), *out] if text else out


def _turn(message: MessageParam, where: str) -> list[Message]:
    content = message.content
    if isinstance(content, str):
        return [Message(message.role, content)]
    texts: list[str] = []
    calls: list[ToolCall] = []
    results: list[Message] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            _only(message, "assistant", "tool_use", at)
            calls.append(ToolCall(block.id, block.name, _object(block.input, f"{at}.input")))
        elif isinstance(block, ToolResultBlock):
            _only(message, "user", "tool_result", at)
            results.append(Message("tool", _result_text(block, at), tool_call_id=block.tool_use_id))
        elif isinstance(block, RefusedBlock):
            raise _refused_block(block, at)
        # Thinking blocks: an earlier turn's, left out of the prompt.
    text = "\n".join(texts) if texts else None
    if message.role == "assistant":
        return [Message("assistant", text if text or not calls else None, calls)]
    turn = [Message(message.role, text)] if text is not None or not results else []
    return results + turn


def _only(message: MessageParam, role: str, kind: str, at: str) -> None:
    if message.role != role:
        raise ApiError(400, f"a '{kind}' block belongs in a{'n' if role[0] == 'a' else ''} "
                       f"{role} message, not a {message.role} one", param=f"{at}.type",
                       code="invalid_value")


def _object(raw: msgspec.Raw, at: str) -> str:
    text = bytes(raw).decode()
    if not text.lstrip().startswith("{"):
        raise ApiError(400, f"'{at}' must be a JSON object", param=at, code="invalid_value")
    return text


def _result_text(block: ToolResultBlock, at: str) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = "\n".join(_result_part(part, f"{at}.content[{k}]") for k, part in enumerate(content))
    return ERROR_RESULT + text if block.is_error else text


def _result_part(part: ResultPart, at: str) -> str:
    if isinstance(part, TextBlock):
        return part.text
    if isinstance(part, ToolReferenceBlock):
        return f"Tool loaded: {part.tool_name}"
    raise _refused_block(part, at)


def _refused_block(block: RefusedBlock, at: str) -> ApiError:
    kind = "image" if type(block).__name__ == "ImageBlock" else "document"
    return ApiError(400, f"'{at}' is an {kind} block, which this server cannot read: only text, "
                    "tool_use and tool_result blocks are", param=f"{at}.type",
                    code="unsupported_content")


def offered_tools(tools: Sequence[Tool] | None) -> list[ToolFunction]:
    """The functions offered to the model: every tool but those whose loading is deferred."""
    check_count(len(tools or ()), "tools")
    return [tool_function(t.name, t.description, t.input_schema, f"tools[{i}].input_schema")
            for i, t in enumerate(tools or ()) if not t.defer_loading]


def tool_use(req: _Prompt, single: bool) -> ToolUse | None:
    """The request's ToolUse, chat's (proxy/openai/tool_requests.py): None without tools."""
    functions = offered_tools(req.tools)
    choice: ToolChoice | None = req.tool_choice
    if choice is None:
        return resolve(functions, None, None, None, "tools", single)
    if choice.type == "tool" and choice.name is None:
        raise ApiError(400, "missing required field 'tool_choice.name'", param="tool_choice.name",
                       code="missing_required_parameter")
    if choice.type != "tool" and choice.name is not None:
        raise ApiError(400, f"'tool_choice.name' is only allowed with type 'tool', not "
                       f"'{choice.type}'", param="tool_choice.name", code="invalid_value")
    word = {"auto": "auto", "any": "required", "none": "none", "tool": None}[choice.type]
    parallel = None if choice.disable_parallel_tool_use is None else (
        not choice.disable_parallel_tool_use)
    return resolve(functions, word, choice.name, parallel, "tools", single)  # type: ignore[arg-type]


def check_prompt(req: _Prompt) -> None:
    """What the types cannot say: thinking asked for, and a prefill (a last assistant turn to
    continue), which the chat path does not serve, as Anthropic refuses it for models without."""
    kind = req.thinking.type if req.thinking is not None else "disabled"
    if kind not in ("adaptive", "disabled"):
        raise ApiError(400, f"'thinking' of type '{kind}' is not supported by this server: "
                       f"{NO_REASONING} (send 'adaptive' or 'disabled')", param="thinking.type",
                       code="unsupported_parameter")
    if req.messages[-1].role == "assistant":
        last = len(req.messages) - 1
        raise ApiError(400, f"'messages[{last}]' is an assistant message: prefilling the answer "
                       "is not supported by this server; end with a user message",
                       param=f"messages[{last}].role", code="unsupported_parameter")


def sampling(req: MessagesRequest, max_model_len: int | None,
             defaults: GenerationDefaults | None) -> SamplingParams:
    """The record for the daemon. `max_tokens` is a ceiling: the daemon holds the output to the
    room the prompt leaves (`max_tokens_ceiling`), so the proxy only bounds it by the context."""
    max_tokens = req.max_tokens if max_model_len is None else min(req.max_tokens, max_model_len)
    fields = _SamplingFields(req.temperature, req.top_p, req.top_k)
    fmt = req.output_config.format if req.output_config is not None else None
    guide = None if fmt is None else strict_schema_guide(fmt.schema, "output_config.format")
    return SamplingParams(max_tokens=max_tokens, max_tokens_ceiling=True,
                          **model_sampling(fields, defaults), stop=list(req.stop_sequences or ()),
                          guide=guide)


@dataclasses.dataclass(slots=True)
class _SamplingFields:
    """What proxy/openai/schemas.py's model_sampling reads; the Messages API has no min_p nor
    repetition_penalty (the model's defaults apply), nor num_speculative_tokens."""

    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None = None
    repetition_penalty: float | None = None
    num_speculative_tokens: int | None = None

