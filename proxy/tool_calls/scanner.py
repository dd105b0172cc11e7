"""One tool call's JSON object read as it streams: ``{"name": "f", "arguments": {...}}``.

The scanner is fed the object a piece at a time, wherever the pieces were cut, and says what
each piece adds: the name once its string has closed, the text of the arguments as it arrives
(the raw JSON of the value, as the model wrote it; a value written as a JSON string is decoded,
since some models quote their arguments), and where the object ended. Keys may come in any
order (Hermes 2 Pro writes the arguments first), with any whitespace; ``parameters`` is
Llama 3's name for the arguments. Anything else is `failed`: not a call object.

With ``arguments_only`` it reads the arguments alone (Mistral's ``name[ARGS]{...}``, whose
name the parser read).
"""

from __future__ import annotations

import enum
import json
import re

ARGUMENT_KEYS = ("arguments", "parameters")

_WS = " \t\r\n"
_STRING_STOP = re.compile(r'["\\]')
_VALUE_STOP = re.compile(r'[{}\[\]"]')
_SCALAR_END = re.compile(r"[,}\]\s]")


class _At(enum.Enum):
    START = enum.auto()  # before the opening brace
    KEY = enum.auto()  # where a key (or the closing brace) goes
    KEY_TEXT = enum.auto()  # inside a key's string
    COLON = enum.auto()
    VALUE = enum.auto()  # where a value starts
    IN_VALUE = enum.auto()  # inside a value
    AFTER_VALUE = enum.auto()  # a comma or the closing brace
    DONE = enum.auto()
    FAILED = enum.auto()


class CallScanner:
    __slots__ = ("_arguments_only", "_at", "_depth", "_escaped", "_in_string", "_key", "_quoted",
                 "_scalar", "_value", "name")

    def __init__(self, arguments_only: bool = False) -> None:
        self.name: str | None = None
        self._arguments_only = arguments_only
        self._at = _At.VALUE if arguments_only else _At.START
        self._key = "arguments" if arguments_only else ""  # the key being read, raw
        self._value: list[str] = []  # the name's or a quoted argument's raw text
        self._depth = 0  # open brackets of the value being read
        self._in_string = False
        self._escaped = False
        self._scalar = False  # the value is a number, true, false or null
        self._quoted = False  # the arguments are a JSON string

    @property
    def done(self) -> bool:
        return self._at is _At.DONE

    @property
    def failed(self) -> bool:
        return self._at is _At.FAILED

    def feed(self, text: str) -> tuple[str, str]:
        """Reads `text`: the arguments' text it adds, and what follows the object when the
        object ended in it (then `done`, or `failed` at the first character that is not part of
        a call object)."""
        args: list[str] = []
        i, n = 0, len(text)
        while i < n and self._at is not _At.DONE and self._at is not _At.FAILED:
            i = self._step(text, i, args)
        rest = text[i:] if self._at is _At.DONE or self._at is _At.FAILED else ""
        return "".join(args), rest

    def _step(self, text: str, i: int, args: list[str]) -> int:
        at = self._at
        if at is _At.KEY_TEXT:
            return self._read_key(text, i)
        if at is _At.IN_VALUE:
            return self._read_value(text, i, args)
        while i < len(text) and text[i] in _WS:
            i += 1
        if i == len(text):
            return i
        char = text[i]
        if at is _At.START:
            self._at = _At.KEY if char == "{" else _At.FAILED
        elif at is _At.KEY:
            self._at, self._key = (_At.KEY_TEXT, "") if char == '"' else (
                _At.DONE if char == "}" else _At.FAILED, "")
        elif at is _At.COLON:
            self._at = _At.VALUE if char == ":" else _At.FAILED
        elif at is _At.AFTER_VALUE:
            self._at = _At.KEY if char == "," else _At.DONE if char == "}" else _At.FAILED
        else:  # VALUE
            return self._start_value(text, i)
        return i + 1 if self._at is not _At.FAILED else i

    def _read_key(self, text: str, i: int) -> int:
        end = self._string_end(text, i)
        self._key += text[i:end]
        if end == len(text):
            return end
        self._at = _At.COLON
        return end + 1

    def _start_value(self, text: str, i: int) -> int:
        key = self._decoded('"' + self._key + '"')
        self._value = []
        self._depth, self._in_string, self._escaped = 0, False, False
        self._scalar = text[i] not in '{["'
        if key == "name":
            if text[i] != '"':
                self._at = _At.FAILED
                return i
            self._key = "name"
        elif key in ARGUMENT_KEYS:
            self._key = "arguments"
            self._quoted = text[i] == '"'
        else:
            self._key = ""
        self._at = _At.IN_VALUE
        return i

    def _read_value(self, text: str, i: int, args: list[str]) -> int:
        end = self._value_end(text, i)
        piece = text[i:end if end is not None else len(text)]
        if self._key == "arguments" and not self._quoted:
            args.append(piece)
        elif self._key:
            self._value.append(piece)
        if end is None:
            return len(text)
        if self._key == "name":
            name = self._decoded("".join(self._value))
            self.name = name if isinstance(name, str) else None
        elif self._key == "arguments" and self._quoted:
            decoded = self._decoded("".join(self._value))
            args.append(decoded if isinstance(decoded, str) else "")
        done = self._arguments_only
        self._at = _At.DONE if done else _At.AFTER_VALUE
        return end

    def _value_end(self, text: str, i: int) -> int | None:
        """Where the value being read ends in `text` from `i` (just past it), or None."""
        if self._scalar:
            match = _SCALAR_END.search(text, i)
            return None if match is None else match.start()
        n = len(text)
        while i < n:
            if self._in_string:
                end = self._string_end(text, i)
                if end == n:
                    return None
                self._in_string = False
                i = end + 1
                if self._depth == 0:
                    return i  # the value was a string
                continue
            match = _VALUE_STOP.search(text, i)
            if match is None:
                return None
            char, i = match.group(), match.end()
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth <= 0:
                    return i
        return None

    def _string_end(self, text: str, i: int) -> int:
        """The index of the quote that closes the string being read, or len(text); escapes
        are followed across pieces."""
        n = len(text)
        while i < n:
            if self._escaped:
                self._escaped = False
                i += 1
                continue
            match = _STRING_STOP.search(text, i)
            if match is None:
                return n
            if match.group() == '"':
                return match.start()
            self._escaped = True
            i = match.end()
        return n

    @staticmethod
    def _decoded(raw: str) -> object:
        try:
            return json.loads(raw)
        except ValueError:
            return None
