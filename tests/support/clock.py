"""A clock for code that takes one (`clock=`): it moves only when the test says."""

from __future__ import annotations

import time


class StepClock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
