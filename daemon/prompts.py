"""Prompt rendering: a Submit's prompts as token ids, for the engine to admit.

Completions' prompts are encoded (or their ids checked against the vocabulary); chat and
Responses messages and tools go through the model's chat template (`chat_text`, with each
message and tool in the shape templates read). Nothing here knows of the engine's sequences,
blocks or the scheduler: it takes a Submit, the tokenizer and the context's bound in bytes and
returns ids, or refuses with a `Rejected` naming the field.

What a prompt costs before it is refused is bounded by the context, not by what a client sent
or stored (`encode_within`): a text with more bytes than the context's tokens can spell
(`ContextBytes`) is refused untokenized, a stored history of more is refused unread, and a long
text is counted a piece at a time, from its end, only until it is past the context.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

from daemon.model.tokenizer import Tokenizer
from daemon.rejected import ContextBytes, Rejected
from ipc.reasons import Reason
from ipc.records import Message, RequestKind, Submit, ToolCall, ToolFunction

History = Callable[[Submit, ContextBytes], list[Message]]

# A text of up to this many bytes a token of the context is tokenized whole at once: real text
# averages 2-5 bytes a token, so a prompt that fits rarely takes the counting path.
DENSE_BYTES = 8
# The counting path's pieces (in characters), each cut before whitespace that follows other text
# where the last quarter of a piece has one (a pre-tokenizer splits there too), and what one cut
# may add to a count.
PIECE_CHARS = 1 << 14
CUT_SLACK = 2
_BOUNDARY = re.compile(r"(?<=\S)\s")


def max_token_bytes(tokenizer: Tokenizer) -> int:
    """The most bytes one token of the vocabulary spells (special tokens included)."""
    return max(1, max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size)))


def render_prompts(submit: Submit, tokenizer: Tokenizer, history: History | None,
                   bound: ContextBytes) -> list[list[int]]:
    """Token ids of each distinct prompt (one for chat and responses); `history` gives a
    response's messages (None: there is no response store). A prompt that cannot fit `bound`
    is refused before it is wholly tokenized."""
    if submit.kind is RequestKind.COMPLETION:
        if submit.prompt_ids:
            prompts = [list(ids) for ids in submit.prompt_ids]
            check_ids([t for ids in prompts for t in ids], tokenizer.vocab_size, "prompt")
        elif not submit.prompts:
            raise Rejected("prompt must not be empty", param="prompt")
        else:
            prompts = [_encode(submit, tokenizer, t, bound, True) if t else []
                       for t in submit.prompts]
    else:
        if submit.kind is RequestKind.CHAT:
            if not submit.messages:
                raise Rejected("messages must contain at least one message", param="messages")
            text = chat_text(tokenizer, submit.messages, submit.tools)
        else:
            if history is None or submit.response is None:
                raise Rejected("the Responses API needs the response store", Reason.NO_STORE)
            text = chat_text(tokenizer, history(submit, bound), submit.tools)
        # The template writes its own special tokens (BOS included).
        prompts = [_encode(submit, tokenizer, text, bound, False)]
    if any(not ids for ids in prompts):
        raise Rejected("prompt must not be empty", param="prompt")
    return prompts


def _encode(submit: Submit, tokenizer: Tokenizer, text: str, bound: ContextBytes,
            add_special_tokens: bool) -> list[int]:
    ids = encode_within(tokenizer, text, bound, add_special_tokens)
    if isinstance(ids, list):
        return ids
    part, what, advice = too_long(submit, bound.tokens)
    if ids > bound.max_bytes:
        raise bound.refusal(what, ids, part, advice)
    raise Rejected(f"this model's maximum context length is {bound.tokens} tokens, but {what} "
                   f"has more than {bound.tokens} tokens; {advice}", param=part,
                   reason=Reason.CONTEXT_LENGTH_EXCEEDED)


def encode_within(tokenizer: Tokenizer, text: str, bound: ContextBytes,
                  add_special_tokens: bool = False) -> list[int] | int:
    """The text's ids; or, for a text that cannot fit ``bound.tokens``, its size in bytes.

    A text of more than ``bound.max_bytes`` is not tokenized at all. A shorter one that is
    still long is counted in pieces from its end, stopping as soon as they hold more tokens
    than the context (less a slack for each cut, which can only add a token or two to a
    piece's count): what the tick spends on a prompt it refuses follows the context, not the
    text. Only a text the pieces say fits is tokenized whole."""
    size = len(text.encode())
    if size > bound.max_bytes:
        return size
    if size > DENSE_BYTES * bound.tokens:
        count = 0
        for cuts, piece in enumerate(pieces(text)):
            count += len(tokenizer.encode(piece, add_special_tokens=False))
            if count > bound.tokens + CUT_SLACK * cuts:
                return size
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def pieces(text: str) -> Iterator[str]:
    """The text in pieces of about PIECE_CHARS, from its end."""
    end = len(text)
    while end > 0:
        start = _cut(text, end - PIECE_CHARS)
        yield text[start:end]
        end = start


def _cut(text: str, at: int) -> int:
    """Where a piece ending before ``at`` starts: at the last whitespace that follows other
    text in the quarter of a piece before ``at``, or at ``at`` itself."""
    if at <= 0:
        return 0
    last = None
    for match in _BOUNDARY.finditer(text, max(1, at - PIECE_CHARS // 4), at):
        last = match.start()
    return at if last is None else last


def chat_text(tokenizer: Tokenizer, messages: list[Message], tools: list[ToolFunction],
              add_generation_prompt: bool = True) -> str:
    rows = [template_message(m) for m in messages]
    try:
        return tokenizer.apply_chat_template(rows, add_generation_prompt=add_generation_prompt,
                                             tools=[template_tool(t) for t in tools] or None)
    except Exception as e:  # a template may raise anything (jinja2's raise_exception, ...)
        raise Rejected(f"messages cannot be rendered by the chat template: {e}",
                       param="messages") from None


# A turn of one call and one of two, as a probe of the template: ids of nine letters and digits,
# which Mistral's templates require.
_PROBE_TOOL = ToolFunction("probe", "A probe.", '{"type": "object", "properties": {}}')
_PROBE_CALLS = [ToolCall(f"call{i}abcd", "probe", "{}") for i in range(2)]


def single_tool_call(tokenizer: Tokenizer) -> bool:
    """Whether the chat template renders an assistant turn of one tool call but refuses one of
    two (Llama 3.1 to 3.3's raise "This model only supports single tool-calls at once!"): then
    the model is never asked for more than one call a turn, since a turn of several could not
    be sent back. False when the template renders neither: nothing is known of it."""
    def renders(calls: list[ToolCall]) -> bool:
        turns = [Message("user", "Probe."), Message("assistant", None, calls),
                 *(Message("tool", "{}", tool_call_id=c.id) for c in calls)]
        try:
            chat_text(tokenizer, turns, [_PROBE_TOOL])
        except Rejected:
            return False
        return True

    return renders(_PROBE_CALLS[:1]) and not renders(_PROBE_CALLS)


def template_message(message: Message) -> dict[str, Any]:
    """A message as a chat template reads it: OpenAI's chat shape, with each call's arguments
    as an object, which is what templates expect (transformers' documentation; vLLM does the
    same). Keys a message does not have are left out (templates test `'tool_calls' in m`), but
    every message has a content: a null one, an assistant turn of calls alone, is "" as vLLM
    renders it, since templates read `message.content` (Qwen3's fails without it) and would
    print "None"."""
    row: dict[str, Any] = {"role": message.role, "content": message.content or ""}
    if message.tool_calls:
        row["tool_calls"] = [{"id": call.id, "type": "function",
                              "function": {"name": call.name,
                                           "arguments": _arguments(call.arguments)}}
                             for call in message.tool_calls]
    if message.tool_call_id is not None:
        row["tool_call_id"] = message.tool_call_id
    return row


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text  # not JSON: as the client sent it
    return value if isinstance(value, dict) else text


def template_tool(tool: ToolFunction) -> dict[str, Any]:
    """A tool as transformers' apply_chat_template takes a JSON-schema one."""
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = json.loads(tool.parameters)
    return {"type": "function", "function": function}


def check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = sorted({t for t in ids if not 0 <= t < vocab_size})
    if bad:
        shown = bad if len(bad) <= 8 else [*bad[:8], "..."]
        raise Rejected(f"{param} holds token ids outside the vocabulary (0..{vocab_size - 1}): "
                       f"{shown}", param=param)


def too_long(submit: Submit, max_model_len: int) -> tuple[str, str, str]:
    """The part of a request whose prompt alone fills the context: its param, how the message
    names it, and what to do."""
    if submit.kind is RequestKind.COMPLETION:
        return "prompt", "the prompt", "shorten the prompt"
    if submit.kind is RequestKind.CHAT:
        return "messages", "the prompt", "shorten the messages"
    fields = submit.response
    if fields is not None and (fields.previous_response_id or fields.conversation) is not None:
        # No token is shorter than a byte, so an input of fewer bytes than the context fits
        # by itself: the conversation it continues is what fills the context.
        own = sum(len((m.content or "").encode()) for m in fields.input)
        own += len(fields.instructions.encode()) if fields.instructions else 0
        if own < max_model_len and fields.conversation is not None:
            return ("conversation", f"conversation '{fields.conversation}' with this turn's "
                    "input", "start a new conversation")
        if own < max_model_len:
            return ("previous_response_id", "the conversation (previous_response_id's history "
                    "and input)", "start a new conversation without previous_response_id")
    return "input", "the prompt", "shorten the input"
