"""Stop strings: matched on detokenized text, never emitted, also when they span tokens.

Text that could still become the start of a stop string is held back until the next token
decides it, so a client never sees the first half of a stop string.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold_max = max((len(s) for s in self.stops), default=1) - 1
        self._firsts = frozenset(s[0] for s in self.stops)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that stopped it

    def push(self, text: str, can_stop: bool = True) -> str:
        """Feed new text; return what may be emitted now. Sets `stopped` on a match.

        With `can_stop` False (min_tokens not reached yet) a complete stop string is let through.
        """
        if self.stopped:
            return ""
        if not self.stops:  # nothing is ever held back: the common case, at no cost
            return text
        buf = self._held + text
        if can_stop and self.stops:
            match = _first_match(buf, self.stops)
            if match is not None:
                cut, self.matched = match
                self.stopped = True
                self._held = ""
                return buf[:cut]
        keep = self._prefix_suffix_len(buf)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """The held-back text, once the sequence ends for another reason."""
        out, self._held = self._held, ""
        return "" if self.stopped else out

    def _prefix_suffix_len(self, buf: str) -> int:
        # Longest suffix of buf that is a proper prefix of some stop string.
        # Only where a stop string's first character is can one start.
        for k in range(min(len(buf), self._hold_max), 0, -1):
            if buf[-k] not in self._firsts:
                continue
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


def _first_match(buf: str, stops: list[str]) -> tuple[int, str] | None:
    """Where the earliest stop string starts, and which it is."""
    found = [(i, s) for s in stops if (i := buf.find(s)) >= 0]
    return min(found, key=lambda f: f[0]) if found else None
