"""Closings: the bytes that take a matcher from where it is to an accepting state, which the
budget of daemon/engine/grammar.py keeps room for.

The search is greedy over single-byte tokens (a vocabulary's token per byte, where it has one)
and never touches the matcher it is given. Its cost is the client's to choose (an ambiguous
grammar makes every matcher call dearer, one that never closes walks as far as it may), so
every search runs under a `SearchBound`: a number of matcher steps and a deadline, whichever
comes first. Each matcher call's own cost is bounded by the parser limits the grammar was
compiled with (daemon/engine/grammar.py), so the deadline is overrun by one call at most.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum
from typing import NamedTuple

import llguidance

# The closing search gives up beyond this many bytes (the budget then cannot be kept).
MAX_CLOSING = 4096
# Bytes that end a structure soonest, first: a closing bracket (JSON's, and the ones grammars
# nest with), a one-character value, an empty container.
_PREFERRED = [ord(c) for c in '}])>0"[{ntf,:']
_ORDER = [*_PREFERRED, *(b for b in range(256) if b not in _PREFERRED)]
# Inside free text (a string, a regex class), the byte that ends it first.
_FREE_ORDER = [ord('"'), *(b for b in _ORDER if b != ord('"'))]
_PROBES = [ord(c) for c in "aQz7~ "]  # all allowed: free text


class Stopped(Enum):
    """Why a search found no closing."""

    BOUND = "bound"  # its SearchBound ran out
    TOO_LONG = "too_long"  # MAX_CLOSING bytes and still open
    DEAD_END = "dead_end"  # no byte token leads on
    PARSER_LIMIT = "parser_limit"  # the matcher hit its parser limits on the way


class Closing(NamedTuple):
    """A way to close the output from a matcher's state: its bytes, and at most how many tokens
    they take (exact once tokenized; a byte count, which no tokenization exceeds, before)."""

    text: bytes
    cost: int


class SearchBound:
    """The work and time one search may take: `steps` tokens consumed or checked by the matcher
    (a call that checks k tokens spends k), until `deadline` on `clock`."""

    __slots__ = ("_clock", "deadline", "exhausted", "steps", "steps_left")

    def __init__(self, steps: int, deadline: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.steps = steps
        self.steps_left = steps
        self.deadline = deadline
        self.exhausted = False
        self._clock = clock

    @classmethod
    def within(cls, steps: int, seconds: float,
               clock: Callable[[], float] = time.monotonic) -> SearchBound:
        return cls(steps, clock() + seconds, clock)

    def spend(self, steps: int = 1) -> bool:
        """Whether `steps` more may be spent (they are counted); False once over the bound."""
        if self.exhausted:
            return False
        if self.steps_left < steps or self._clock() >= self.deadline:
            self.exhausted = True
            return False
        self.steps_left -= steps
        return True


def closing(matcher: llguidance.LLMatcher, byte_tokens: dict[int, int],
            bound: SearchBound) -> bytes | Stopped:
    """A short string of bytes that takes `matcher` to an accepting state (without touching it),
    or why none was found.

    Greedy over single bytes: the forced bytes first, then, where the grammar allows a wide set
    (free text), the byte that closes a string, and elsewhere the bytes that end a structure
    soonest (close, a one-character value, an empty container) before anything else."""
    m = matcher.deep_copy()
    out = bytearray()
    while len(out) < MAX_CLOSING:
        if m.is_accepting():
            return bytes(out)
        if not bound.spend():
            return Stopped.BOUND
        forced = m.compute_ff_bytes()
        if forced:
            if not bound.spend(len(forced)):
                return Stopped.BOUND
            if not _consume_bytes(m, forced, byte_tokens):
                return _dead_end(m)
            out += forced
            continue
        choice = _next_byte(m, byte_tokens, bound)
        if choice is None:
            return Stopped.BOUND if bound.exhausted else _dead_end(m)
        m.consume_token(byte_tokens[choice])
        out.append(choice)
    return Stopped.TOO_LONG


def _dead_end(m: llguidance.LLMatcher) -> Stopped:
    return Stopped.PARSER_LIMIT if m.is_error() else Stopped.DEAD_END


def _consume_bytes(m: llguidance.LLMatcher, data: bytes, byte_tokens: dict[int, int]) -> bool:
    for b in data:
        token = byte_tokens.get(b)
        if token is None or not m.consume_token(token):
            return False
    return True


def _allowed(m: llguidance.LLMatcher, byte: int, byte_tokens: dict[int, int],
             bound: SearchBound) -> bool:
    token = byte_tokens.get(byte)
    return token is not None and bound.spend() and m.validate_tokens([token]) == 1


def _next_byte(m: llguidance.LLMatcher, byte_tokens: dict[int, int],
               bound: SearchBound) -> int | None:
    if m.is_error():  # a parser limit hit by the last byte: nothing is allowed any more
        return None
    free = all(_allowed(m, b, byte_tokens, bound) for b in _PROBES)
    for b in _FREE_ORDER if free else _ORDER:
        if _allowed(m, b, byte_tokens, bound):
            return b
        if bound.exhausted:
            return None
    return None


def utf8_rest(raw: bytes) -> bytes:
    """Continuation bytes that finish the UTF-8 character `raw` ends in the middle of, if it
    does (the first one within the range its lead byte allows)."""
    for back in range(1, min(3, len(raw)) + 1):
        lead = raw[-back]
        if lead & 0xC0 == 0x80:
            continue
        need = 1 if lead & 0xE0 == 0xC0 else 2 if lead & 0xF0 == 0xE0 else (
            3 if lead & 0xF8 == 0xF0 else 0)
        missing = need - (back - 1)
        if missing <= 0:
            return b""
        first = {0xE0: 0xA0, 0xF0: 0x90}.get(lead, 0x80) if back == 1 else 0x80
        return bytes([first] + [0x80] * (missing - 1))
    return b""
