"""POST /v1/messages and /v1/messages/count_tokens bodies, as Anthropic's Messages API spells
them, validated by msgspec while decoding (an unknown field, or a block of an unknown type, is a
400 naming it). The marks are proxy/fields.py's, so docs/api.md lists these fields as it lists
the OpenAI routes'.

Claude Code sends every request with ``system`` as text blocks carrying ``cache_control``, a
``system``-role message inside ``messages``, ``thinking: {"type": "adaptive"}``,
``context_management`` clearing thinking, ``output_config.effort``, ``metadata.user_id``, tools
with ``defer_loading`` and ``max_tokens: 32000`` (docs/endpoints.md has the whole of it): each is
honoured here or is a no-op that cannot change the answer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from proxy.fields import CACHE_HINT, END_USER, LATENCY_HINT, honoured, no_op, refused
from proxy.openai.schemas import PositiveInt, TopK, TopP
from proxy.openai.tool_requests import TOOLS_NOTE

MAX_STOP_SEQUENCES = 16  # as the OpenAI routes' `stop`

# Anthropic's temperature runs from 0 to 1.
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
# Anthropic's rule for tool names.
ToolName = Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]

NO_REASONING = "no model served here reasons"
MAX_TOKENS_NOTE = (
    "a ceiling, as Anthropic reads it: past the room the prompt leaves in the context it means "
    "that room (Claude Code sends 32000 whatever the model)")
SYSTEM_NOTE = "a string or text blocks; their `cache_control` is a no-op (" + CACHE_HINT + ")"
THINKING_NOTE = (
    "`adaptive` and `disabled` are no thinking, which is what adaptive thinking is on a model "
    "that does not reason; `enabled` (a thinking budget) and `between_tools` are a 400: "
    + NO_REASONING)
OUTPUT_CONFIG_NOTE = (
    "`format` (`json_schema`) makes the answer's text JSON that follows the schema, its objects "
    "closed unless they say `additionalProperties` (as Anthropic's structured outputs); with "
    "tools the answer is calls or that JSON. `effort` is a no-op: it steers a reasoning model's "
    "thinking; " + NO_REASONING)
TOOLS_ANTHROPIC = (
    TOOLS_NOTE.replace("`parameters`", "`input_schema`").replace(
        " (a namespace's functions count one each)", "")
    + "; a tool with `defer_loading` is not offered to the model (Anthropic's reading), nor "
    "can it be forced")


class CacheControl(msgspec.Struct, forbid_unknown_fields=True):
    """A prompt-cache breakpoint: a no-op, the prefix cache is automatic."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None  # an earlier answer's: nothing the model reads


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type", forbid_unknown_fields=True):
    id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    name: ToolName
    input: msgspec.Raw  # a JSON object, passed on as the client's text
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None  # programmatic tool calling's: who made the call


class ToolReferenceBlock(msgspec.Struct, tag="tool_reference", tag_field="type",
                         forbid_unknown_fields=True):
    """A deferred tool a tool search found (advanced-tool-use), in a tool_result."""

    tool_name: str
    cache_control: CacheControl | None = None


class RefusedBlock(msgspec.Struct, tag_field="type"):
    """A block of a kind this server cannot read (an image, a document): decoded only so that
    its 400 names it (proxy/anthropic/translate.py)."""


class ImageBlock(RefusedBlock, tag="image"):
    source: Any = None
    cache_control: Any = None


class DocumentBlock(RefusedBlock, tag="document"):
    source: Any = None
    cache_control: Any = None
    title: Any = None
    context: Any = None
    citations: Any = None


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type", forbid_unknown_fields=True):
    """An earlier turn's thinking, which a client sends back: never written here, and left out
    of the prompt, as Anthropic leaves out every earlier turn's."""

    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, tag="redacted_thinking", tag_field="type",
                            forbid_unknown_fields=True):
    data: str


ResultPart = TextBlock | ToolReferenceBlock | ImageBlock | DocumentBlock


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type",
                      forbid_unknown_fields=True):
    tool_use_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    content: str | list[ResultPart] | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None


Block = (TextBlock | ToolUseBlock | ToolResultBlock | ImageBlock | DocumentBlock | ThinkingBlock
         | RedactedThinkingBlock)


class MessageParam(msgspec.Struct, forbid_unknown_fields=True):
    # `system` inside the messages: Claude Code sends its environment so, after the user's turn.
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    name: ToolName
    input_schema: msgspec.Raw  # a JSON schema, kept as the client's text (proxy/openai/tool_requests.py)
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    defer_loading: bool | None = None
    strict: bool | None = None  # the input follows the schema anyway when it is forced
    eager_input_streaming: bool | None = None  # a latency hint: input streams as written anyway


class ToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["adaptive", "disabled", "enabled", "between_tools"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class ClearThinking(msgspec.Struct, forbid_unknown_fields=True):
    """The only context edit accepted: clearing thinking, which is never kept here. Clearing
    old tool results would change the prompt, so any other edit is a 400 naming its type."""

    type: Literal["clear_thinking_20251015"]
    keep: Any = None


class ContextManagement(msgspec.Struct, forbid_unknown_fields=True):
    edits: list[ClearThinking] = []


class JsonOutputFormat(msgspec.Struct, forbid_unknown_fields=True):
    """Structured outputs: the answer's text is JSON that follows `schema`."""

    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, forbid_unknown_fields=True):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class Metadata(msgspec.Struct, forbid_unknown_fields=True):
    user_id: Annotated[str, msgspec.Meta(max_length=4096)] | None = None


class _Prompt(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a prompt is made of: the fields count_tokens shares with messages."""

    model: str
    messages: Annotated[list[MessageParam], msgspec.Meta(min_length=1)]
    system: Annotated[str | list[TextBlock] | None, honoured(SYSTEM_NOTE)] = None
    tools: Annotated[list[Tool] | None, honoured(TOOLS_ANTHROPIC)] = None
    tool_choice: ToolChoice | None = None
    thinking: Annotated[Thinking | None, honoured(THINKING_NOTE)] = None
    context_management: Annotated[ContextManagement | None, no_op(
        "only clear_thinking edits are accepted, and no thinking is kept here to clear",
        {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]})] = None
    output_config: Annotated[OutputConfig | None, honoured(OUTPUT_CONFIG_NOTE)] = None
    cache_control: Annotated[CacheControl | None, no_op(CACHE_HINT, {"type": "ephemeral"})] = None
    speed: Annotated[str | None, no_op(LATENCY_HINT, "fast")] = None
    user_profile_id: Annotated[str | None, no_op(END_USER, "p-1")] = None
    workspace_id: Annotated[str | None, no_op(
        "an Anthropic account's workspace: a key here names its tenant", "wrkspc_1")] = None
    mcp_servers: Annotated[Any, refused("no MCP server is called", [{"type": "url"}])] = None


class MessagesRequest(_Prompt, kw_only=True):
    """The marks: see proxy/fields.py."""

    max_tokens: Annotated[PositiveInt, honoured(MAX_TOKENS_NOTE)]
    stream: bool = False
    stop_sequences: Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]],
                              msgspec.Meta(max_length=MAX_STOP_SEQUENCES)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    metadata: Annotated[Metadata | None, no_op(END_USER, {"user_id": "u-1"})] = None
    service_tier: Annotated[str | None, no_op(LATENCY_HINT, "auto")] = None
    inference_geo: Annotated[str | None, no_op(
        "the region of Anthropic's servers to run in: this server runs where it is", "us")] = None
    container: Annotated[Any, refused("no code runs here", "c-1")] = None
    diagnostics: Annotated[Any, refused("no prompt-cache diagnostics are reported",
                                        {"previous_message_id": "msg_1"})] = None


class CountTokensRequest(_Prompt, kw_only=True):
    """count_tokens takes what makes a prompt; the marks: see proxy/fields.py."""
