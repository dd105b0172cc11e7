"""What every format's parser shares: the events it gives, its calls, and its text around them.

A parser is fed an output's text a piece at a time, cut wherever the tokens (or merged deltas,
or the ticks) cut it, and turns it into events: content, a call begun (its index, id and name,
once), a piece of that call's arguments. The same events come out however the text was cut, so
a stream and a collected answer say the same thing. A call is only begun once its name has been
read and names an offered function; until then what it has read is held, and a call that turns
out not to be one (no name, a name nobody offered, not JSON) is given back as content while the
output has had no call yet (after one, text outside calls is not content, as in vLLM's parsers).
Whitespace right before a call is dropped, and whitespace that ends the content is held until
the output says what follows it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from proxy.tool_calls.scanner import CallScanner

_WS = " \t\r\n"


@dataclass(slots=True, frozen=True)
class Content:
    text: str


@dataclass(slots=True, frozen=True)
class CallStart:
    index: int
    call_id: str
    name: str


@dataclass(slots=True, frozen=True)
class CallArguments:
    index: int
    text: str


Event = Content | CallStart | CallArguments


def find_marker(text: str, markers: tuple[str, ...]) -> tuple[str, str | None, str]:
    """(the text before the first marker, that marker, the text after it); with no marker,
    (the text that cannot begin one, None, the tail that may: to be held for the next piece)."""
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    if found:
        i, marker = min(found)
        return text[:i], marker, text[i + len(marker):]
    for start in range(max(0, len(text) - max(map(len, markers)) + 1), len(text)):
        tail = text[start:]
        if any(m.startswith(tail) for m in markers):
            return text[:start], None, tail
    return text, None, ""


class OpenCall:
    __slots__ = ("index", "pending", "raw", "scanner")

    def __init__(self, scanner: CallScanner, head: str) -> None:
        self.scanner = scanner
        self.raw = [head]  # what it has read while it is not yet begun
        self.pending: list[str] = []  # arguments read before the name
        self.index: int | None = None  # once begun


class FormatParser:
    """The machinery; each format's subclass reads the text outside calls (`_outside`)."""

    def __init__(self, names: frozenset[str], make_id: Callable[[int], str],
                 parallel: bool = True) -> None:
        self.names = names
        self.make_id = make_id
        self.parallel = parallel
        self.num_calls = 0
        self._out: list[Event] = []
        self._held = ""  # a tail that may begin a marker
        self._ws = ""  # whitespace that ends the content so far
        self._call: OpenCall | None = None

    def feed(self, text: str) -> list[Event]:
        if text:
            self._parse(text)
        out, self._out = self._out, []
        return out

    def end(self) -> list[Event]:
        """The output ended: what was held goes out (an open call ends where it is)."""
        call = self._call
        if call is not None and call.index is None:
            self._give_back(call, "")
        self._call = None
        held, self._held = self._held, ""
        self._text(held)
        if self._ws and not self.num_calls:
            self._out.append(Content(self._ws))
        self._ws = ""
        out, self._out = self._out, []
        return out

    def _parse(self, text: str) -> None:
        while text:
            if self._call is None:
                text = self._outside(text)
                continue
            rest = self._feed_call(text)
            if rest is None:
                return
            text = rest

    def _outside(self, text: str) -> str:
        """Reads text outside any call up to where one opens (`_open`); what is left of it."""
        raise NotImplementedError

    # --- for the formats ------------------------------------------------------------------------

    @property
    def _closed(self) -> bool:
        """No more calls are taken (parallel_tool_calls false, and one was made)."""
        return not self.parallel and self.num_calls > 0

    def _text(self, text: str) -> None:
        """Text outside calls: content until the first call, nothing after it."""
        if self.num_calls or not text:
            return
        text = self._ws + text
        kept = text.rstrip(_WS)
        self._ws = text[len(kept):]
        if kept:
            self._out.append(Content(kept))

    def _open(self, head: str, name: str | None = None) -> None:
        """A call begins; `head` is the text that said so (given back if it is not one). With
        `name` (read by the format) the text that follows is the arguments alone."""
        call = self._call = OpenCall(CallScanner(arguments_only=name is not None),
                                     self._ws + head)
        self._ws = ""
        if name is not None:
            call.scanner.name = name
            self._begin(call)

    def _feed_call(self, text: str) -> str | None:
        """Feeds the open call; what follows it once it ended (else None)."""
        call = self._call
        assert call is not None
        args, rest = call.scanner.feed(text)
        if call.index is None:
            consumed = text[:len(text) - len(rest)] if rest else text
            call.raw.append(consumed)
            call.pending.append(args)
            self._begin(call)
        elif args:
            self._out.append(CallArguments(call.index, args))
        scanner = call.scanner
        if not (scanner.done or scanner.failed):
            return None
        self._call = None
        if call.index is None:
            self._give_back(call, rest)
            return ""
        return rest

    def _begin(self, call: OpenCall) -> None:
        name = call.scanner.name
        if name is None or name not in self.names or self._closed:
            return
        call.index = self.num_calls
        self.num_calls += 1
        self._out.append(CallStart(call.index, self.make_id(call.index), name))
        args = "".join(call.pending)
        if args:
            self._out.append(CallArguments(call.index, args))
        call.raw, call.pending = [], []

    def _give_back(self, call: OpenCall, rest: str) -> None:
        """Not a call: its text is content (while no call has been made), and so is what
        follows, parsed again."""
        self._text("".join(call.raw))
        if rest:
            self._parse(rest)
