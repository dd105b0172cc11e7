"""A background response's events as its readers get them, numbered from 0, whose oldest may be
let go to bound what the proxy holds.

Each event is weighed once, as the JSON a reader is sent; the registry of runs
(proxy/responses/background.py) keeps the sum of all runs' weights under its bound. An event's
number is its ``sequence_number``: ``first`` is the oldest still held, and ``len()`` the next.
"""

from __future__ import annotations

import orjson

from proxy.responses.events import Event


class EventHistory:
    __slots__ = ("_events", "_sizes", "first", "nbytes")

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._sizes: list[int] = []
        self.first = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return self.first + len(self._events)

    def __getitem__(self, number: int) -> Event:
        """Event ``number`` (negative: from the newest), if it is still held."""
        return self._events[number if number < 0 else number - self.first]

    def append(self, events: list[Event]) -> int:
        """Holds `events` after the others; returns the bytes they weigh."""
        added = 0
        for event in events:
            size = len(orjson.dumps(event))
            self._events.append(event)
            self._sizes.append(size)
            added += size
        self.nbytes += added
        return added

    def since(self, number: int) -> list[Event]:
        """The events from ``number`` on; ``number`` must not be older than ``first``."""
        return self._events[number - self.first:]

    def let_go(self, nbytes: int) -> int:
        """Drops the oldest events until `nbytes` are freed, always keeping the newest (the
        ending a late reader needs); returns the bytes freed."""
        freed = count = 0
        while freed < nbytes and count < len(self._events) - 1:
            freed += self._sizes[count]
            count += 1
        del self._events[:count], self._sizes[:count]
        self.first += count
        self.nbytes -= freed
        return freed
