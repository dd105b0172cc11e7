"""JSON numbers that stay finite: the grammar's number is RFC 8259's, whose exponent has no
bound, and a random model writes `1e999`, which JavaScript, orjson and Python's float read as
Infinity (issue 34: a json_object answer held Infinity). llguidance's JSON compiler has no
option to bound it, so the constraint watches the numbers of a JSON output as they are written:
a sampled token that would take one past MAX_EXPONENT_DIGITS exponent digits or
MAX_INTEGER_DIGITS integer digits (10^(200 + 99) < 1.8e308) is replaced by the closing, as one
that leaves no room to close is (daemon/engine/constraint.py).

`NumberGuard` reads the output a byte at a time: whether it is inside a string (escapes
followed), and the part of the number being written and its digits so far.
"""

from __future__ import annotations

import enum

from ipc.records import Guide, GuideKind

MAX_EXPONENT_DIGITS = 2
MAX_INTEGER_DIGITS = 200
_DIGITS = frozenset(b"0123456789")
# Bytes that change nothing outside a string and a number, and inside a string.
_OUTSIDE_PLAIN = bytes(b for b in range(256) if b not in b'"-0123456789')
_STRING_PLAIN = bytes(b for b in range(256) if b not in b'"\\')


class _At(enum.Enum):
    OUTSIDE = enum.auto()
    STRING = enum.auto()
    ESCAPE = enum.auto()  # after a backslash in a string
    INTEGER = enum.auto()
    FRACTION = enum.auto()
    EXPONENT = enum.auto()


def guards_numbers(guide: Guide) -> bool:
    """Whether `guide`'s output is JSON (a schema, an object, a tool call's arguments): a
    regex or a grammar of the client's own says what its numbers may be."""
    return (guide.kind is GuideKind.JSON_SCHEMA or guide.kind is GuideKind.JSON_OBJECT
            or (guide.kind is GuideKind.GRAMMAR and guide.source == "tools"))


class NumberGuard:
    __slots__ = ("_at", "_digits")

    def __init__(self) -> None:
        self._at = _At.OUTSIDE
        self._digits = 0  # of the number's part being written

    def fits(self, raw: bytes) -> bool:
        """Whether the output may go on with `raw` (nothing is moved)."""
        if self._unmoved(raw):
            return True
        at, digits = self._at, self._digits
        ok = self._push(raw)
        self._at, self._digits = at, digits
        return ok

    def push(self, raw: bytes) -> None:
        """The output went on with `raw`."""
        if not self._unmoved(raw):
            self._push(raw)

    def _unmoved(self, raw: bytes) -> bool:
        """`raw` leaves the state as it is (most tokens: text in a string, punctuation)."""
        at = self._at
        plain = (_OUTSIDE_PLAIN if at is _At.OUTSIDE else _STRING_PLAIN if at is _At.STRING
                 else None)
        return plain is not None and not raw.translate(None, plain)

    def _push(self, raw: bytes) -> bool:
        """Reads `raw`; False if a number grew past its bounds on the way."""
        ok = True
        for b in raw:
            at = self._at
            if at is _At.STRING:
                self._at = _At.ESCAPE if b == 0x5C else _At.OUTSIDE if b == 0x22 else at
            elif at is _At.ESCAPE:
                self._at = _At.STRING
            elif at is _At.OUTSIDE:
                self._start(b)
            elif b in _DIGITS:
                self._digits += 1
                limit = MAX_EXPONENT_DIGITS if at is _At.EXPONENT else (
                    MAX_INTEGER_DIGITS if at is _At.INTEGER else None)
                ok = ok and (limit is None or self._digits <= limit)
            elif b == 0x2E and at is _At.INTEGER:  # "."
                self._at, self._digits = _At.FRACTION, 0
            elif b in b"eE" and at is not _At.EXPONENT:
                self._at, self._digits = _At.EXPONENT, 0
            elif b in b"+-" and at is _At.EXPONENT and self._digits == 0:
                pass
            else:  # the number ended
                self._at = _At.OUTSIDE
                self._start(b)
        return ok

    def _start(self, b: int) -> None:
        if b == 0x22:
            self._at = _At.STRING
        elif b == 0x2D or b in _DIGITS:  # "-" or a digit
            self._at, self._digits = _At.INTEGER, int(b != 0x2D)
