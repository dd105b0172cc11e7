"""Closings: the bytes that take a matcher from where it is to an accepting state, which the
budget of daemon/engine/grammar.py keeps room for.

The search is greedy over single-byte tokens (a vocabulary's token per byte, where it has one)
and never touches the matcher it is given.
"""

from __future__ import annotations

from typing import NamedTuple

import llguidance

# The closing search gives up beyond this many bytes (the budget then cannot be kept).
MAX_CLOSING = 4096
_PREFERRED = [ord(c) for c in '}]0"[{ntf,:']  # bytes that end a structure soonest, first


class Closing(NamedTuple):
    """A way to close the output from a matcher's state: its bytes, and at most how many tokens
    they take (exact once tokenized; a byte count, which no tokenization exceeds, before)."""

    text: bytes
    cost: int


def closing(matcher: llguidance.LLMatcher, byte_tokens: dict[int, int]) -> bytes | None:
    """A short string of bytes that takes `matcher` to an accepting state (without touching it),
    or None when none is found within MAX_CLOSING bytes.

    Greedy over single bytes: the forced bytes first, then, where the grammar allows a wide set
    (free text), the byte that closes a string, and elsewhere the bytes that end a structure
    soonest (close, a one-character value, an empty container) before anything else."""
    m = matcher.deep_copy()
    out = bytearray()
    while len(out) < MAX_CLOSING:
        if m.is_accepting():
            return bytes(out)
        forced = m.compute_ff_bytes()
        if forced:
            if not _consume_bytes(m, forced, byte_tokens):
                return None
            out += forced
            continue
        choice = _next_byte(m, byte_tokens)
        if choice is None:
            return None
        m.consume_token(byte_tokens[choice])
        out.append(choice)
    return None


def _consume_bytes(m: llguidance.LLMatcher, data: bytes, byte_tokens: dict[int, int]) -> bool:
    for b in data:
        token = byte_tokens.get(b)
        if token is None or not m.consume_token(token):
            return False
    return True


def _allowed(m: llguidance.LLMatcher, byte: int, byte_tokens: dict[int, int]) -> bool:
    token = byte_tokens.get(byte)
    return token is not None and m.validate_tokens([token]) == 1


_PROBES = [ord(c) for c in "aQz7~ "]  # all allowed: free text (inside a string, a regex class)


def _next_byte(m: llguidance.LLMatcher, byte_tokens: dict[int, int]) -> int | None:
    if all(_allowed(m, b, byte_tokens) for b in _PROBES):
        order = [ord('"'), *_PREFERRED]
    else:
        order = _PREFERRED
    for b in order:
        if _allowed(m, b, byte_tokens):
            return b
    for b in range(256):
        if _allowed(m, b, byte_tokens):
            return b
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
