"""The Responses API's input items: typed and bounded on the way in, turned into chat messages,
listed on the way out.

An item is decoded by msgspec, in C, into the types below, or refused with a 400 naming the
field: every field is bounded as OpenAI bounds it (an item's ``id`` at most 64 characters, its
role and its parts' types one of a few words) and a field the server does not know is OpenAI's
``unknown_parameter``. So nothing a client sends is stored or listed back unless it is rendered
(the text) or bounded, an item is never deeper than its type, and the decoder refuses what does
not fit without building it, however large or nested the rest: no request's validation walks
a body in Python.

The items are a union tagged on ``type``, which OpenAI's easy message leaves out: a msgspec
union needs the tag, so the body's items arrive as raw JSON, each decoded by the union, or, with
no ``type`` of its own, as a message.

Turned into the conversation: messages as they are; a function call joins the assistant turn
before it as a tool call, its output is a tool turn (a custom tool's call and output alike, its
input the one string argument it is offered with); a reasoning item is kept and listed but
left out of the prompt (no model served here reasons in a form it could be given back).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import msgspec

from ipc.records import Message, ToolCall
from proxy.bodies import validation_error
from proxy.http.errors import ApiError
from proxy.openai.tool_requests import CUSTOM_INPUT, FunctionName, qualified

MAX_ITEM_ID = 64  # OpenAI's bound on input[].id
MAX_CALL_ID = 256

ItemId = Annotated[str, msgspec.Meta(max_length=MAX_ITEM_ID)]
CallId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CALL_ID)]
Role = Literal["user", "assistant", "system", "developer"]
Status = Literal["in_progress", "completed", "incomplete"]
# Chat templates rarely know "developer"; it plays the same part as "system".
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class InputText(msgspec.Struct, tag="input_text", tag_field="type", forbid_unknown_fields=True):
    text: str


class OutputText(msgspec.Struct, tag="output_text", tag_field="type", forbid_unknown_fields=True):
    """An earlier answer sent back: its annotations and logprobs are accepted (clients echo
    them) and skipped by the decoder, never built nor kept."""

    text: str
    annotations: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    logprobs: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


class Refusal(msgspec.Struct, tag="refusal", tag_field="type", forbid_unknown_fields=True):
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


ContentPart = InputText | OutputText | Refusal


def _has_extras(part: ContentPart) -> bool:
    return isinstance(part, OutputText) and not (
        part.annotations is msgspec.UNSET and part.logprobs is msgspec.UNSET)


def _joined(content: str | list[InputText] | list[ContentPart]) -> str:
    # Parts are pieces of one message: joined, the text is exactly what the client sent.
    return content if isinstance(content, str) else "".join([p.text for p in content])


class MessageItem(msgspec.Struct, tag="message", tag_field="type", forbid_unknown_fields=True,
                  omit_defaults=True):
    role: Role
    content: str | list[ContentPart]
    id: ItemId | None = None
    status: Status | None = None

    def kept(self) -> MessageItem:
        """The item as stored: what is neither rendered nor bounded is left out."""
        content = self.content
        if isinstance(content, str) or not any(_has_extras(p) for p in content):
            return self
        parts: list[ContentPart] = [OutputText(p.text) if isinstance(p, OutputText) else p
                                    for p in content]
        return MessageItem(self.role, parts, self.id, self.status)


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type",
                       forbid_unknown_fields=True, omit_defaults=True):
    call_id: CallId
    name: FunctionName
    arguments: str
    id: ItemId | None = None
    status: Status | None = None
    namespace: FunctionName | None = None  # a namespace tool's function: the group's name


class FunctionCallOutputItem(msgspec.Struct, tag="function_call_output", tag_field="type",
                             forbid_unknown_fields=True, omit_defaults=True):
    call_id: CallId
    output: str | list[InputText]
    id: ItemId | None = None
    status: Status | None = None


class CustomToolCallItem(msgspec.Struct, tag="custom_tool_call", tag_field="type",
                         forbid_unknown_fields=True, omit_defaults=True):
    call_id: CallId
    name: FunctionName
    input: str
    id: ItemId | None = None
    status: Status | None = None


class CustomToolCallOutputItem(FunctionCallOutputItem, tag="custom_tool_call_output"):
    """A custom tool's output: a function's, under its own type."""


class SummaryText(msgspec.Struct, tag="summary_text", tag_field="type",
                  forbid_unknown_fields=True):
    text: str


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type",
                    forbid_unknown_fields=True):
    text: str


class ReasoningItem(msgspec.Struct, tag="reasoning", tag_field="type",
                    forbid_unknown_fields=True, omit_defaults=True):
    """Kept and listed, never rendered; ``encrypted_content`` is another server's to read."""

    summary: list[SummaryText]
    id: ItemId | None = None
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Status | None = None


class ItemReference(msgspec.Struct, tag="item_reference", tag_field="type",
                    forbid_unknown_fields=True):
    """An item of a stored response, named by its id: a request's input only, resolved from
    the store before anything else reads the input (proxy/responses/item_references.py)."""

    id: ItemId


InputItem = (MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
             | CustomToolCallItem | CustomToolCallOutputItem)
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning",
              "custom_tool_call", "custom_tool_call_output")
# A request's input items: each costs the proxy's loop and the daemon's tick its own work
# (decoding, rendering, indexing), so they are bounded in number as well as by the body's bytes
# (as many as a conversation holds).
MAX_INPUT_ITEMS = 10_000
NonEmptyRaws = Annotated[list[msgspec.Raw], msgspec.Meta(min_length=1, max_length=MAX_INPUT_ITEMS)]

_item = msgspec.json.Decoder(InputItem)
_input = msgspec.json.Decoder(InputItem | ItemReference)
_message = msgspec.json.Decoder(MessageItem)
_NO_TYPE = "Object missing required field `type`"


def decode_items(raws: list[msgspec.Raw], field: str = "input") -> list[InputItem]:
    """Each raw item decoded, in C; ApiError(400) naming ``<field>[i]`` and the field."""
    return [_decode_item(raw, f"{field}[{i}]", _item) for i, raw in enumerate(raws)]


def decode_input(raws: list[msgspec.Raw]) -> list[InputItem | ItemReference]:
    """A request's input items, as `decode_items`; item references are left to resolve."""
    return [_decode_item(raw, f"input[{i}]", _input) for i, raw in enumerate(raws)]


def decode_stored(raw: bytes, where: str) -> InputItem:
    """An item as the store gave it back."""
    return _decode_item(msgspec.Raw(raw), where, _item)


def _decode_item(raw: msgspec.Raw, where: str, decoder: msgspec.json.Decoder[Any]) -> Any:
    try:
        if b'"type"' in bytes(raw):  # (one in its parts only: the union says so at once)
            try:
                return decoder.decode(raw)
            except msgspec.ValidationError as exc:
                if str(exc) != _NO_TYPE:
                    raise
        return _message.decode(raw)
    except msgspec.ValidationError as exc:
        text = str(exc)
        at = " - at `$"
        text = (text.replace(at, f"{at}.{where}", 1) if at in text else f"{text}{at}.{where}`")
        raise explain_unsupported(validation_error(text)) from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None


def to_messages(input: str | list[InputItem]) -> list[Message]:
    """The conversation the items say."""
    if isinstance(input, str):
        return [Message("user", input)]
    out: list[Message] = []
    for item in input:
        if isinstance(item, MessageItem):
            out.append(Message(_ROLES[item.role], _joined(item.content)))
        elif isinstance(item, FunctionCallItem | CustomToolCallItem):
            call = _tool_call(item)
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                out[-1] = Message("assistant", last.content, [*last.tool_calls, call])
            else:
                out.append(Message("assistant", None, [call]))
        elif isinstance(item, FunctionCallOutputItem):
            out.append(Message("tool", _joined(item.output), tool_call_id=item.call_id))
    return out


def _tool_call(item: FunctionCallItem | CustomToolCallItem) -> ToolCall:
    if isinstance(item, CustomToolCallItem):
        # As the model writes the call (proxy/tool_calls/grammar.py): what it saw in its prompt.
        arguments = json.dumps({CUSTOM_INPUT: item.input}, ensure_ascii=False)
        return ToolCall(item.call_id, item.name, arguments)
    return ToolCall(item.call_id, qualified(item.namespace, item.name), item.arguments)


def stored_items(input: str | list[InputItem]) -> str:
    """The items as the store keeps them (JSON text): a string input is one user message."""
    items = [MessageItem("user", input)] if isinstance(input, str) else [
        item.kept() if isinstance(item, MessageItem) else item for item in input]
    return msgspec.json.encode(items).decode()


_TYPE_PARAM = re.compile(r"^(input|items)\[\d+\](?P<part>\.content\[\d+\])?\.type$")
_INVALID = re.compile(r"^invalid value for '[^']*': Invalid value '(?P<kind>.*)'$", re.DOTALL)


def explain_unsupported(error: ApiError) -> ApiError:
    """The decoder's "Invalid value" for an item's or a part's ``type`` as the types served."""
    typed = _TYPE_PARAM.match(error.param or "")
    invalid = _INVALID.match(error.message)
    if typed is None or invalid is None:
        return error
    kind = invalid.group("kind")
    kind = kind if len(kind) <= MAX_ITEM_ID else kind[:MAX_ITEM_ID] + "..."
    if typed.group("part"):
        what = (f"unsupported content part '{kind}'; only 'input_text', 'output_text' and "
                "'refusal' are accepted")
    else:
        # A request's input may also name an item of a stored response; a conversation's not.
        types = (*ITEM_TYPES, "item_reference") if typed.group(1) == "input" else ITEM_TYPES
        served = ", ".join(f"'{t}'" for t in types)
        what = f"unsupported item type '{kind}'; the types accepted are {served}"
    return ApiError(400, f"Invalid '{error.param}': {what}", param=error.param,
                    code="invalid_value")


_raw_fields = msgspec.json.Decoder(list[dict[str, msgspec.Raw]])
_COMPLETED = msgspec.Raw(b'"completed"')


def listed_items(items: str, ids: list[str]) -> bytes:
    """A page of stored input items (JSON text, as the daemon sent it, and the id each is listed
    under) as the API lists them, as JSON: messages with typed parts, other items as stored.
    Rows stored by earlier releases hold messages as their client sent them, so each is read
    leniently. Each field's value stays the raw JSON it was stored as: items of megabytes
    cost a copy, not a decoding and an encoding."""
    out: list[dict[str, Any]] = []
    for item_id, item in zip(ids, _raw_fields.decode(items), strict=True):
        kind = msgspec.json.decode(item.get("type", b'"message"'))
        status = item.get("status", _COMPLETED)
        if kind != "message":
            out.append({**item, "id": item_id, "status": status})
            continue
        content: Any = item.get("content", msgspec.Raw(b"null"))
        if memoryview(content)[:1] == b'"':  # a string: one part of text
            role = msgspec.json.decode(item.get("role", b"null"))
            content = [{"type": "output_text" if role == "assistant" else "input_text",
                        "text": content}]
        out.append({"id": item_id, "type": "message", "role": item.get("role"),
                    "status": status, "content": content})
    return msgspec.json.encode(out)


def input_item_objects(items: str, ids: list[str]) -> list[dict[str, Any]]:
    """`listed_items`, as Python objects."""
    listed: list[dict[str, Any]] = msgspec.json.decode(listed_items(items, ids))
    return listed
