"""The Responses API's input items: typed and bounded on the way in, listed on the way out.

An item is decoded by msgspec, in C, into the types below, or refused with a 400 naming the
field: every field is bounded as OpenAI bounds it (an item's ``id`` at most 64 characters, its
role and its parts' types one of a few words) and a field the server does not know is OpenAI's
``unknown_parameter``. So nothing a client sends is stored or listed back unless it is rendered
(the text) or bounded, an item is never deeper than its type, and the decoder refuses what does
not fit without building it, however large or nested the rest: no request's validation walks
a body in Python.

`MessageItem` is the one item type served. Other types (function_call, function_call_output,
reasoning, ...) join as Structs tagged on "type" in a union; a msgspec union needs the tag in
every item, while OpenAI's "easy" message leaves ``type`` out, so the union's decoder must then
be given items whose missing ``type`` reads "message".
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from ipc.records import Message
from proxy.errors import ApiError

MAX_ITEM_ID = 64  # OpenAI's bound on input[].id

ItemId = Annotated[str, msgspec.Meta(max_length=MAX_ITEM_ID)]
Role = Literal["user", "assistant", "system", "developer"]
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


ContentPart = InputText | OutputText


def _has_extras(part: ContentPart) -> bool:
    return isinstance(part, OutputText) and not (
        part.annotations is msgspec.UNSET and part.logprobs is msgspec.UNSET)


class MessageItem(msgspec.Struct, tag="message", tag_field="type", forbid_unknown_fields=True,
                  omit_defaults=True):
    role: Role
    content: str | list[ContentPart]
    id: ItemId | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def to_message(self) -> Message:
        content = self.content
        # Parts are pieces of one message: joined, the text is exactly what the client sent.
        text = content if isinstance(content, str) else "".join([p.text for p in content])
        return Message(_ROLES[self.role], text)

    def kept(self) -> MessageItem:
        """The item as stored: what is neither rendered nor bounded is left out."""
        content = self.content
        if isinstance(content, str) or not any(_has_extras(p) for p in content):
            return self
        parts: list[ContentPart] = [OutputText(p.text) if isinstance(p, OutputText) else p
                                    for p in content]
        return MessageItem(self.role, parts, self.id, self.status)


InputItem = MessageItem
NonEmptyItems = Annotated[list[InputItem], msgspec.Meta(min_length=1)]


def to_messages(input: str | list[InputItem]) -> list[Message]:
    if isinstance(input, str):
        return [Message("user", input)]
    return [item.to_message() for item in input]


def stored_items(input: str | list[InputItem]) -> str:
    """The items as the store keeps them (JSON text): a string input is one user message."""
    items = [MessageItem("user", input)] if isinstance(input, str) else [
        item.kept() for item in input]
    return msgspec.json.encode(items).decode()


_TYPE_PARAM = re.compile(r"^input\[\d+\](?P<part>\.content\[\d+\])?\.type$")
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
        what = (f"unsupported content part '{kind}'; only 'input_text' and 'output_text' are "
                "accepted")
    else:
        what = f"unsupported item type '{kind}'; only 'message' items are accepted"
    return ApiError(400, f"Invalid '{error.param}': {what}", param=error.param,
                    code="invalid_value")


def input_item_objects(items: str, ids: list[str]) -> list[dict[str, Any]]:
    """A page of stored input items (JSON text, as the daemon sent it, and the id each is listed
    under) as the API lists them: messages with typed parts. Rows stored by earlier releases
    hold items as their client sent them, so each is read leniently."""
    out = []
    for item_id, item in zip(ids, msgspec.json.decode(items), strict=True):
        content = item.get("content")
        if isinstance(content, str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            content = [{"type": kind, "text": content}]
        out.append({"id": item_id, "type": "message", "role": item.get("role"),
                    "status": item.get("status", "completed"), "content": content})
    return out
