"""Turning a Submit into sequences: render the prompt, check the limits, or reject it.

Every rejection is an `Error` record naming the request field and the limit, so the proxy can
answer the client without knowing anything about tokens.

What a prompt costs the tick before it is refused is bounded by the context, not by what a
client sent or stored (`encode_within`): a text with more bytes than the context's tokens can
spell (`ContextBytes`) is refused untokenized, a stored history of more is refused unread, and a
long text is counted a piece at a time, from its end, only until it is past the context.
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from daemon.engine.block_manager import BlockManager
from daemon.engine.echo import make_echoes
from daemon.engine.logits_processors import bad_word_ids
from daemon.engine.sampler import seed_for
from daemon.engine.sequence import Detokenizer, Sequence
from daemon.engine.stops import StopMatcher
from daemon.model.tokenizer import Tokenizer
from daemon.rejected import ContextBytes, Rejected
from ipc.records import AbortCause, Message, RequestKind, Submit, ToolCall, ToolFunction

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
                raise Rejected("the Responses API needs the response store", status=500)
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
    part, what, advice = _too_long(submit, bound.tokens)
    if ids > bound.max_bytes:
        raise bound.refusal(what, ids, part, advice)
    raise Rejected(f"this model's maximum context length is {bound.tokens} tokens, but {what} "
                   f"has more than {bound.tokens} tokens; {advice}", param=part,
                   code="context_length_exceeded")


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


def check_sequences(submit: Submit, max_num_seqs: int, max_seqs_per_request: int | None) -> None:
    """A prompt's n siblings run at once, so n fits in a batch; and however its sequences are
    made up, one request has at most `max_seqs_per_request` (the proxy checks it first)."""
    if submit.n > max_num_seqs:
        raise Rejected(f"n ({submit.n}) exceeds the server's limit of {max_num_seqs}",
                       param="n")
    count = submit.num_sequences
    if max_seqs_per_request is not None and count > max_seqs_per_request:
        made_of = (f"{len(submit.prompts)} prompts x n={submit.n}"
                   if submit.kind is RequestKind.COMPLETION else f"n={submit.n}")
        raise Rejected(f"the request asks for {count} sequences ({made_of}), more than the "
                       f"server's limit of {max_seqs_per_request} per request",
                       param="n" if submit.n > 1 else "prompt", code="too_many_sequences")


def check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = sorted({t for t in ids if not 0 <= t < vocab_size})
    if bad:
        shown = bad if len(bad) <= 8 else [*bad[:8], "..."]
        raise Rejected(f"{param} holds token ids outside the vocabulary (0..{vocab_size - 1}): "
                       f"{shown}", param=param)


def check_limits(submit: Submit, prompts: list[list[int]], max_model_len: int,
                 block_manager: BlockManager, vocab_size: int) -> None:
    params = submit.sampling
    check_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    check_ids(list(params.logit_bias), vocab_size, "logit_bias")
    param = "max_output_tokens" if submit.kind is RequestKind.RESPONSE else "max_tokens"
    longest = max(len(p) for p in prompts)
    if params.max_tokens is None:  # the rest of the context: only the prompt can be too long
        _check_room(submit, longest, max_model_len, block_manager)
        return
    max_tokens = params.max_tokens
    if params.max_tokens_ceiling and max_tokens > output_room(longest, submit.n, max_model_len,
                                                              block_manager):
        _check_room(submit, longest, max_model_len, block_manager)  # the room is the ceiling
        return
    if longest + max_tokens > max_model_len:
        room = max_model_len - longest
        if room > 0:
            raise Rejected(
                f"this model's maximum context length is {max_model_len} tokens, but the prompt "
                f"has {longest} tokens and {param} is {max_tokens} ({longest + max_tokens} in "
                f"total); reduce {param} to at most {room}", param=param,
                code="context_length_exceeded")
        part, what, advice = _too_long(submit, max_model_len)
        raise Rejected(
            f"this model's maximum context length is {max_model_len} tokens, but {what} has "
            f"{longest} tokens, with no room left for the output; {advice}", param=part,
            code="context_length_exceeded")
    # One sequence and its forked siblings' copied blocks must fit, or it could never run.
    need = (block_manager.num_blocks_for(longest + max_tokens)
            + block_manager.fork_cost(longest) * (submit.n - 1))
    if need > block_manager.num_total:
        cap = block_manager.num_total * block_manager.block_size
        raise Rejected(f"the prompt ({longest} tokens) plus {param} ({max_tokens}) with n="
                       f"{submit.n} exceeds the KV cache capacity of {cap} tokens",
                       param=param)


def _check_room(submit: Submit, longest: int, max_model_len: int,
                block_manager: BlockManager) -> None:
    """An omitted max_tokens: the longest prompt must leave room for at least one token, and
    min_tokens for as many."""
    room = output_room(longest, submit.n, max_model_len, block_manager)
    if room >= max(1, submit.sampling.min_tokens):
        return
    if room >= 1:
        raise Rejected(f"min_tokens ({submit.sampling.min_tokens}) is more than the room the "
                       f"prompt ({longest} tokens) leaves for the output ({room} tokens)",
                       param="min_tokens", code="context_length_exceeded")
    part, what, advice = _too_long(submit, max_model_len)
    if longest < max_model_len:
        cap = block_manager.num_total * block_manager.block_size
        raise Rejected(f"{what} ({longest} tokens) with n={submit.n} leaves no room for the "
                       f"output in the KV cache capacity of {cap} tokens; {advice}", param=part)
    raise Rejected(
        f"this model's maximum context length is {max_model_len} tokens, but {what} has "
        f"{longest} tokens, with no room left for the output; {advice}", param=part,
        code="context_length_exceeded")


def output_room(prompt_len: int, n: int, max_model_len: int, block_manager: BlockManager) -> int:
    """Tokens a prompt leaves for its output: the rest of the context, or what the KV cache
    holds for one of its n sequences (with its siblings' copies of the partial block), if less.
    Past that a sequence could never be scheduled alone."""
    bm = block_manager
    blocks = bm.num_total - bm.fork_cost(prompt_len) * (n - 1)
    return min(max_model_len, blocks * bm.block_size) - prompt_len


def _too_long(submit: Submit, max_model_len: int) -> tuple[str, str, str]:
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


def build_sequences(submit: Submit, prompts: list[list[int]],
                    make_detok: Callable[[list[int]], Detokenizer], tokenizer: Tokenizer,
                    max_model_len: int, block_manager: BlockManager) -> list[Sequence]:
    """All sequences in index order; sample 0 of each prompt carries its siblings to fork. An
    omitted max_tokens becomes each prompt's room for the output (`output_room`), as does a
    ceiling above it."""
    params = submit.sampling
    bad_words = bad_word_ids(params.bad_words,
                             lambda text: tokenizer.encode(text, add_special_tokens=False))
    seqs: list[Sequence] = []
    for p, (ids, echo) in enumerate(zip(prompts, make_echoes(submit, prompts, tokenizer),
                                        strict=True)):
        room = output_room(len(ids), submit.n, max_model_len, block_manager)
        max_tokens = room if params.max_tokens is None else (
            min(params.max_tokens, room) if params.max_tokens_ceiling else params.max_tokens)
        group = [
            Sequence(rid=submit.rid, index=p * submit.n + s, token_ids=list(ids), params=params,
                     detok=make_detok(ids), stops=StopMatcher(params.stop),
                     seed=None if params.seed is None else seed_for(params.seed, s),
                     max_tokens=max_tokens, bad_words=bad_words, echo=echo)
            for s in range(submit.n)
        ]
        group[0].fork_children = group[1:]
        seqs.extend(group)
    return seqs


class Tombstones:
    """Rids aborted before their Submit arrived: bounded in number and in age, and each used
    once (the Submit it was waiting for takes it away)."""

    def __init__(self, max_size: int = 65536, ttl_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_size = max_size
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, AbortCause, float | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, rid: str, cause: AbortCause, t_disconnect: float | None = None) -> None:
        self._entries[rid] = (self._clock() + self.ttl_s, cause, t_disconnect)
        self._entries.move_to_end(rid)
        self._expire()

    def pop(self, rid: str) -> tuple[AbortCause, float | None] | None:
        """The abort waiting for this rid (its cause and disconnect time), removed."""
        self._expire()
        entry = self._entries.pop(rid, None)
        return None if entry is None else (entry[1], entry[2])

    def _expire(self) -> None:
        now = self._clock()
        while self._entries:
            rid, (expiry, _, _) = next(iter(self._entries.items()))
            if expiry > now and len(self._entries) <= self.max_size:
                return
            del self._entries[rid]
