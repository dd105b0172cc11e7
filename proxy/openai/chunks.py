"""The SSE events of one completions or chat stream, built with as little per-token work as
possible, byte for byte what dumping each whole chunk dict gives.

Every chunk is ``{**head, "choices": [choice], **usage}``: its constant bytes are encoded once.
Most events are a plain delta (not its choice's first, no log-probabilities, some text); for
those, the choice is rendered once per choice with marks where the text and the token ids go,
and each event splices the token's own bytes in. Anything else renders its choice as a dict:
a prompt's echo (its ids as vLLM's ``prompt_token_ids``), and every event of a stream with
continuous usage (vLLM's ``continuous_usage_stats``: each chunk's usage is its choice's so far).
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from ipc.records import Delta, Finish, TokenLogprob
from proxy.http.sse import sse_json

# Where a plain delta's text and token ids go in its pre-rendered choice. JSON renders NUL as
# "\u0000", which nothing else in a chunk contains.
_TEXT = "\x00text\x00"
_IDS = "\x00ids\x00"
_TEXT_JSON = orjson.dumps(_TEXT)
_IDS_JSON = orjson.dumps(_IDS)


class ChoiceShape(Protocol):
    def chunk_choice(self, index: int, text: str, finish: str | None,
                     first: bool) -> dict[str, Any]: ...

    def logprobs(self, lps: list[TokenLogprob], offset: int) -> dict[str, Any]: ...


class StreamChunks:
    __slots__ = ("_after", "_before", "_offsets", "_plain", "_prompt_offsets", "_shape",
                 "_started", "_token_ids", "_usage")

    def __init__(self, shape: ChoiceShape, head: dict[str, Any], include_usage: bool,
                 token_ids: bool, continuous_usage: bool = False) -> None:
        self._shape = shape
        self._token_ids = token_ids
        self._before = b"data: " + sse_json(head)[:-1] + b',"choices":['
        self._after = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"
        self._started: set[int] = set()  # choices whose first event went out
        self._offsets: dict[int, int] = {}  # per choice, where its next delta starts in its text
        self._prompt_offsets: dict[int, int] = {}  # the same, within its echoed prompt
        self._plain: dict[int, list[bytes]] = {}  # per choice, a plain delta's bytes around marks
        # Per choice, [prompt tokens, completion tokens so far] (continuous usage only).
        self._usage: dict[int, list[int]] | None = {} if continuous_usage else None

    def delta(self, record: Delta) -> bytes:
        if self._usage is not None:
            counts = self._usage.setdefault(record.index, [0, 0])
            if record.prompt:
                counts[0] = counts[0] or len(record.token_ids)
            else:
                counts[0] = record.prompt_tokens or counts[0]
                counts[1] += len(record.token_ids)
        elif (record.text and record.logprobs is None and record.index in self._started
              and not record.prompt):
            parts = self._plain.get(record.index) or self._plain_parts(record.index)
            text = sse_json(record.text)
            if self._token_ids:
                return parts[0] + text + parts[1] + orjson.dumps(record.token_ids) + parts[2]
            return parts[0] + text + parts[1]
        return self._render(record, None)

    def finish(self, record: Finish, reason: str) -> bytes:
        """A sequence's last event; `reason` is its OpenAI finish_reason."""
        if self._usage is not None:
            self._usage[record.index] = [record.usage.prompt_tokens,
                                         record.usage.completion_tokens]
        return self._render(record, reason)

    def started(self, index: int) -> bool:
        """Whether choice `index` had its first event."""
        return index in self._started

    def event(self, record: Delta | Finish, choice: dict[str, Any]) -> bytes:
        """The event of `record` with a choice the caller rendered (a chat choice with tool
        calls), its token ids and log-probabilities added."""
        self._started.add(record.index)
        return self._framed(record, choice)

    def _render(self, record: Delta | Finish, finish: str | None) -> bytes:
        first = record.index not in self._started
        self._started.add(record.index)
        text = record.text if isinstance(record, Delta) else ""
        return self._framed(record, self._shape.chunk_choice(record.index, text, finish, first))

    def _framed(self, record: Delta | Finish, choice: dict[str, Any]) -> bytes:
        index = record.index
        delta = record if isinstance(record, Delta) else None
        if self._token_ids and delta is not None:
            choice["token_ids"] = [] if delta.prompt else delta.token_ids
            if delta.prompt and delta.token_ids:
                choice["prompt_token_ids"] = delta.token_ids
        if delta is not None and delta.logprobs is not None:
            offsets = self._prompt_offsets if delta.prompt else self._offsets
            offset = offsets.get(index, 0)
            choice["logprobs"] = self._shape.logprobs(delta.logprobs, offset)
            # A prompt's log-probabilities may come in several Deltas after its text.
            offsets[index] = offset + (len(b"".join(lp.token for lp in delta.logprobs).decode(
                errors="ignore")) if delta.prompt else len(delta.text))
        if delta is not None and delta.prompt:
            self._offsets[index] = self._offsets.get(index, 0) + len(delta.text)
        return self._before + sse_json(choice) + self._usage_after(index)

    def _usage_after(self, index: int) -> bytes:
        if self._usage is None:
            return self._after
        prompt, completion = self._usage.get(index, (0, 0))
        usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion}
        return b'],"usage":' + orjson.dumps(usage) + b"}\n\n"

    def _plain_parts(self, index: int) -> list[bytes]:
        choice = self._shape.chunk_choice(index, _TEXT, None, False)
        if self._token_ids:
            choice["token_ids"] = _IDS
        head, rest = (self._before + sse_json(choice) + self._after).split(_TEXT_JSON)
        parts = [head, *rest.split(_IDS_JSON)]
        assert len(parts) == 2 + self._token_ids, "the text and ids each appear once"
        self._plain[index] = parts
        return parts
