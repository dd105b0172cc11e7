"""A completions or chat request's answer, from the daemon's records: the two endpoints' shapes
of a choice (`Shape`, `ChatShape`), their logprobs, finish reasons and usage, and
`CompletionAnswer`, which renders a batch of records as stream events or collects them into one
body. proxy/openai/completions.py validates the request and runs the exchange around it.
"""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import orjson

from ipc.records import Delta, Finish, FinishReason, RequestKind, Submit, TokenLogprob, ToolCallFormat, Usage
from proxy.engine.batching import Batch
from proxy.engine.collected import Choice, CollectedBudget, Logprobs, joined_arrays, json_array, json_string
from proxy.http.errors import ApiError
from proxy.http.sse import DONE, sse_event
from proxy.openai.chat_tools import ChatToolCalls
from proxy.openai.chunks import StreamChunks
from proxy.tool_calls import ToolUse

# A choice's text: a stream's piece, or a collected answer's text already in JSON.
Text = str | orjson.Fragment


class Shape:
    """How one endpoint renders choices; the flow around it is shared."""

    kind = RequestKind.COMPLETION
    prefix = "cmpl-"
    full_object = "text_completion"
    chunk_object = "text_completion"
    endpoint = "completions"

    def choice(self, index: int, text: Text, finish: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}

    def chunk_choice(self, index: int, text: str, finish: str | None,
                     first: bool) -> dict[str, Any]:
        return self.choice(index, text, finish)

    def logprobs(self, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
        """The legacy completions shape; `offset` is where the first token starts in the text."""
        return {"tokens": [token_string(lp.token) for lp in lps],
                "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [_top(lp) for lp in lps],
                "text_offset": text_offsets([lp.token for lp in lps], offset)}

    def logprobs_json(self, lps: Logprobs) -> bytes:
        """A whole collected choice's `logprobs`, as `logprobs` renders them, in JSON."""
        tokens = lps.tokens()
        tops = joined_arrays(orjson.dumps([_top(lp) for lp in part]) for part in lps.slices())
        return b"".join([b'{"tokens":', json_array([token_string(t) for t in tokens]),
                         b',"token_logprobs":', json_array(lps.values()),
                         b',"top_logprobs":', tops,
                         b',"text_offset":', json_array(text_offsets(tokens, 0)), b"}"])


class ChatShape(Shape):
    kind = RequestKind.CHAT
    prefix = "chatcmpl-"
    full_object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    endpoint = "chat"

    def choice(self, index: int, text: Text, finish: str | None) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": finish}

    def chunk_choice(self, index: int, text: str, finish: str | None,
                     first: bool) -> dict[str, Any]:
        delta: dict[str, str] = {"role": "assistant"} if first else {}
        if text or (first and finish is None):
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}

    def logprobs(self, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
        return {"content": [{**_token(lp.token, lp.logprob),
                             "top_logprobs": [_token(t, v) for t, v in lp.top]} for lp in lps],
                "refusal": None}

    def logprobs_json(self, lps: Logprobs) -> bytes:
        content = joined_arrays(orjson.dumps(self.logprobs(part, 0)["content"])
                                for part in lps.slices())
        return b'{"content":' + content + b',"refusal":null}'


def token_string(raw: bytes) -> str:
    """A token's text as OpenAI shows it: bytes that are not (yet) a whole UTF-8 character
    appear as "\\xe6" escapes; `bytes` carries them exactly."""
    return raw.decode(errors="backslashreplace")


def _token(raw: bytes, logprob: float) -> dict[str, Any]:
    return {"token": token_string(raw), "logprob": logprob, "bytes": list(raw)}


def _top(lp: TokenLogprob) -> dict[str, float] | None:
    if math.isnan(lp.logprob):  # an echoed prompt's first token (`null_first_logprob`)
        return None
    return {token_string(t): v for t, v in lp.top}


def null_first_logprob(record: Delta) -> None:
    """The first token of an echoed prompt has no log-probability: the daemon's placeholder
    becomes NaN, which renders as null (JSON has no NaN), as OpenAI and vLLM show it."""
    if record.prompt and record.token_ids and record.logprobs:
        record.logprobs[0] = TokenLogprob(record.logprobs[0].token, math.nan)


def text_offsets(tokens: list[bytes], offset: int) -> list[int]:
    """Where each token starts in the text, the first at `offset`. A token that starts inside
    a character (its first bytes came with the token before) is placed at that character."""
    seen = b""
    offsets = []
    for raw in tokens:
        offsets.append(offset + len(seen.decode(errors="ignore")))
        seen += raw
    return offsets


COMPLETION = Shape()
CHAT = ChatShape()


def finish_reason(record: Finish) -> str:
    """The OpenAI finish_reason; a sequence the server itself gave up on is an error."""
    if record.reason is FinishReason.STOP or record.reason is FinishReason.LENGTH:
        return record.reason.value
    if record.reason is FinishReason.ABORT:
        cause = record.cause.value if record.cause else "unknown"
        raise ApiError(503, f"the request was aborted by the server ({cause})",
                       code="request_aborted")
    raise ApiError(500, record.message or "the engine failed on this request",
                   code="engine_error")


def usage_body(usages: dict[int, Usage], n: int) -> dict[str, Any]:
    # Every sample of a prompt reports that prompt's tokens: count them once per prompt.
    firsts = [u for i, u in usages.items() if i % n == 0]
    prompt = sum(u.prompt_tokens for u in firsts)
    completion = sum(u.completion_tokens for u in usages.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in firsts)}}


class CompletionAnswer:
    """A completions or chat request's answer: the choices collected into one JSON body, or
    each batch's stream events together (one write; the client's bytes the same as one event at
    a time), the ending, or the error that ends the stream."""

    __slots__ = ("budget", "choices", "chunks", "continuous_usage", "finishes", "head",
                 "include_usage", "num_sequences", "ok", "rid", "shape", "submit_n", "tools",
                 "usages", "wants_logprobs", "wants_token_ids")

    def __init__(self, submit: Submit, shape: Shape, model: str, wants: Wants,
                 budget: CollectedBudget | None = None) -> None:
        self.rid = submit.rid
        self.shape = shape
        self.submit_n = submit.n
        self.num_sequences = submit.num_sequences
        self.include_usage = wants.include_usage
        self.continuous_usage = wants.continuous_usage
        self.wants_token_ids = wants.token_ids
        self.budget = budget  # what collecting may hold
        self.head = {"id": submit.rid, "created": int(time.time()), "model": model}
        self.usages: dict[int, Usage] = {}
        self.ok = False  # every sequence finished (a stream ended with [DONE])
        # Streaming.
        self.chunks: StreamChunks | None = None
        # Collecting.
        self.choices: dict[int, Choice] = {}
        self.wants_logprobs = submit.sampling.logprobs is not None
        self.finishes: dict[int, str] = {}
        use = wants.tool_use
        self.tools = ChatToolCalls(use, wants.tool_format) if use and use.parsed else None

    def _on_finish(self, record: Finish) -> str:
        """Accounts one sequence's end; returns its finish reason."""
        self.usages[record.index] = record.usage
        self.ok = len(self.usages) >= self.num_sequences
        return finish_reason(record)

    def _usage(self) -> dict[str, Any]:
        return usage_body(self.usages, self.submit_n)

    # --- streaming ------------------------------------------------------------------------------

    def render(self, batch: Batch) -> tuple[bytes, bool]:
        if self.chunks is None:
            self.chunks = StreamChunks(self.shape, self._chunk_head(), self.include_usage,
                                       self.wants_token_ids, self.continuous_usage)
        chunks = self.chunks
        events: list[bytes] = []
        try:
            for record in batch:
                if self.tools is not None:
                    reason = None if isinstance(record, Delta) else self._on_finish(record)
                    events.append(self.tools.event(chunks, record, reason, self.wants_token_ids))
                elif isinstance(record, Delta):
                    null_first_logprob(record)
                    events.append(chunks.delta(record))
                else:
                    events.append(chunks.finish(record, self._on_finish(record)))
            if not self.ok:
                return b"".join(events), False
            if self.include_usage:
                events.append(sse_event({**self._chunk_head(), "choices": [],
                                         "usage": self._usage()}))
            events.append(DONE)
        except ApiError as exc:
            # Headers are gone already: the error travels as the last event, after what came
            # before it in its batch.
            self.ok = False
            events.append(self.error(exc))
        return b"".join(events), True

    def error(self, exc: ApiError) -> bytes:
        return sse_event(exc.body())

    def _chunk_head(self) -> dict[str, Any]:
        return {"id": self.rid, "object": self.shape.chunk_object, **self.head}

    # --- collecting -----------------------------------------------------------------------------

    def collect(self, batch: Batch) -> None:
        for record in batch:
            if isinstance(record, Delta):
                if self.budget is not None:
                    self.budget.add(record)
                null_first_logprob(record)
                choice = self.choices.get(record.index)
                if choice is None:
                    choice = self.choices[record.index] = Choice(self.wants_token_ids,
                                                                 self.wants_logprobs)
                choice.add(record)
            else:
                self.finishes[record.index] = self._on_finish(record)

    def body(self) -> dict[str, Any]:
        empty = Choice(self.wants_token_ids, self.wants_logprobs)
        choices = []
        for i in sorted(self.finishes):
            got = self.choices.pop(i, empty)  # let each go once it is rendered
            if self.tools is not None:
                choice = {"index": i, "message": self.tools.message(i, got.text), "logprobs": None,
                          "finish_reason": self.tools.finish_reason(i, self.finishes[i])}
            else:
                choice = self.shape.choice(i, orjson.Fragment(json_string(got.text)),
                                           self.finishes[i])
            if got.token_ids is not None:
                choice["token_ids"] = orjson.Fragment(json_array(got.token_ids))
            if got.prompt_token_ids:  # echo, in vLLM's field
                choice["prompt_token_ids"] = orjson.Fragment(json_array(got.prompt_token_ids))
            if got.logprobs is not None:
                choice["logprobs"] = orjson.Fragment(self.shape.logprobs_json(got.logprobs))
            choices.append(choice)
        return {"id": self.rid, "object": self.shape.full_object, **self.head, "choices": choices,
                "usage": self._usage()}


class Wants(NamedTuple):
    """What the request asked of its answer's form: all of it the handler keeps while the
    request is held (the decoded request itself is let go)."""

    stream: bool
    include_usage: bool
    token_ids: bool
    continuous_usage: bool = False  # usage in every chunk (vLLM's continuous_usage_stats)
    max_tokens_param: str = "max_tokens"  # the field that bounds the output, named in errors
    tool_use: ToolUse | None = None  # the output may hold calls, in tool_format
    tool_format: ToolCallFormat = ToolCallFormat.HERMES
