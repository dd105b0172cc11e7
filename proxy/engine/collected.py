"""What a request that does not stream holds until it is answered, and the bound on it.

A choice's text is joined as it grows, its token ids sit in an array and its log-probabilities
in flat arrays (a TokenLogprob per token with a tuple per alternative took 137 bytes an entry;
these take 12 and the token's own bytes). The answer is rendered a slice of tokens at a time,
so only the JSON itself is ever held whole.

A request is refused up front when what it could collect would not fit in
``--max-collected-bytes``: the estimate is sequences x max_tokens x the bytes a token takes from
arrival to the rendered body, measured by tests/proxy/engine/test_collected.py with tracemalloc. One
without max_tokens (the rest of the context, which only the daemon knows) is not refused for a
limit it never set: its tokens are counted as they come (`CollectedBudget`, an echoed prompt's
too), and it fails with the same 400 only once what it holds passes the bound.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import orjson

from ipc.records import Delta, TokenLogprob
from proxy.http.errors import ApiError

# Bytes the proxy holds per collected token at the peak (the collected choices and the body
# rendered from them), the worse of the two shapes: the text and its token id; a token's
# log-probabilities around its entries; each entry (the sampled token's, each alternative's).
TOKEN_BYTES = 64
LOGPROB_TOKEN_BYTES = 96
LOGPROB_BYTES = 224
# Tokens (or items of a column, or 16 times as many characters of text) encoded at once: orjson
# reserves room for the worst case of what it encodes in one call (~250 bytes an item of a list,
# 12 a character of a string), so whole columns would cost many times the answer.
SLICE_TOKENS = 256
# Text pieces kept apart before they are joined.
_PIECES = 64


def collected_bytes(num_sequences: int, max_tokens: int, logprobs: int | None) -> int:
    """At most what a request that does not stream makes the proxy hold."""
    per_token = TOKEN_BYTES if logprobs is None else (
        TOKEN_BYTES + LOGPROB_TOKEN_BYTES + (1 + logprobs) * LOGPROB_BYTES)
    return num_sequences * max_tokens * per_token


def check_collected(num_sequences: int, max_tokens: int, logprobs: int | None, limit: int,
                    param: str) -> None:
    """400 for a request that does not stream and could collect more than `limit` bytes."""
    need = collected_bytes(num_sequences, max_tokens, logprobs)
    if need > limit:
        alternatives = "" if logprobs is None else f" with {logprobs} logprobs alternatives"
        raise ApiError(400, f"this request could collect up to {need} bytes of output "
                       f"({num_sequences} sequences of up to {max_tokens} tokens"
                       f"{alternatives}), more than the server's limit of {limit} for a "
                       f"response that does not stream; send it with \"stream\": true, or "
                       f"lower {param}, n or logprobs", param=param, code="output_too_large")


class CollectedBudget:
    """What a request that does not stream holds, counted as its tokens arrive."""

    __slots__ = ("limit", "logprobs", "param", "tokens")

    def __init__(self, limit: int, logprobs: int | None, param: str) -> None:
        self.limit, self.logprobs, self.param = limit, logprobs, param
        self.tokens = 0

    def add(self, record: Delta) -> None:
        self.tokens += len(record.token_ids)
        held = collected_bytes(1, self.tokens, self.logprobs)
        if held > self.limit:
            raise ApiError(400, f"this request's output reached {held} bytes ({self.tokens} "
                           f"tokens), more than the server's limit of {self.limit} for a "
                           f"response that does not stream; send it with \"stream\": true, or "
                           f"set {self.param}", param=self.param, code="output_too_large")


class Logprobs:
    """One choice's log-probabilities in flat arrays: every entry (a sampled token, then its
    alternatives) as its bytes in one buffer, where they end, and its value."""

    __slots__ = ("_ends", "_firsts", "_raw", "_values")

    def __init__(self) -> None:
        self._raw = bytearray()
        self._ends = array("I")
        self._values = array("d")
        self._firsts = array("I")  # each token's sampled entry; its alternatives follow it

    def __len__(self) -> int:
        return len(self._firsts)

    def extend(self, lps: list[TokenLogprob]) -> None:
        for lp in lps:
            self._firsts.append(len(self._ends))
            self._add(lp.token, lp.logprob)
            for raw, value in lp.top:
                self._add(raw, value)

    def _add(self, raw: bytes, value: float) -> None:
        self._raw += raw
        self._ends.append(len(self._raw))
        self._values.append(value)

    def _entry(self, i: int) -> tuple[bytes, float]:
        start = self._ends[i - 1] if i else 0
        return bytes(self._raw[start:self._ends[i]]), self._values[i]

    def tokens(self) -> list[bytes]:
        """The sampled tokens' bytes, in order."""
        return [self._entry(i)[0] for i in self._firsts]

    def values(self) -> list[float]:
        """The sampled tokens' log-probabilities, in order."""
        return [self._values[i] for i in self._firsts]

    def slices(self) -> Iterator[list[TokenLogprob]]:
        """The entries again as TokenLogprobs, SLICE_TOKENS at a time."""
        ends = [*self._firsts[1:], len(self._ends)]
        for start in range(0, len(self), SLICE_TOKENS):
            part = []
            for t in range(start, min(start + SLICE_TOKENS, len(self))):
                first = self._firsts[t]
                raw, value = self._entry(first)
                part.append(TokenLogprob(raw, value, [self._entry(i)
                                                      for i in range(first + 1, ends[t])]))
            yield part


class Choice:
    """One sequence's output so far (after its echoed prompt, if it has one)."""

    __slots__ = ("_pieces", "logprobs", "prompt_token_ids", "token_ids")

    def __init__(self, token_ids: bool, logprobs: bool) -> None:
        self._pieces: list[str] = []
        self.token_ids = array("I") if token_ids else None
        self.prompt_token_ids = array("I") if token_ids else None
        self.logprobs = Logprobs() if logprobs else None

    def add(self, record: Delta) -> None:
        self._pieces.append(record.text)
        if len(self._pieces) >= _PIECES:
            self._pieces[:] = ["".join(self._pieces)]
        ids = self.prompt_token_ids if record.prompt else self.token_ids
        if ids is not None:
            ids.extend(record.token_ids)
        if self.logprobs is not None and record.logprobs:
            self.logprobs.extend(record.logprobs)

    @property
    def text(self) -> str:
        return "".join(self._pieces)


def joined_arrays(parts: Iterable[bytes]) -> bytes:
    """JSON arrays rendered one after another, as one array."""
    items = [part[1:-1] for part in parts if part != b"[]"]
    return b"[" + b",".join(items) + b"]"


def json_array(items: Sequence[Any]) -> bytes:
    """`items` as a JSON array, a slice at a time."""
    return joined_arrays(orjson.dumps(list(items[i:i + SLICE_TOKENS]))
                         for i in range(0, len(items), SLICE_TOKENS))


def json_string(text: str) -> bytes:
    """`text` as a JSON string, a slice at a time (a character's escape never spans two)."""
    size = 16 * SLICE_TOKENS
    return b'"' + b"".join(orjson.dumps(text[i:i + size])[1:-1]
                           for i in range(0, len(text), size)) + b'"'
