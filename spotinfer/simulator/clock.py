"""The simulation's clock: a heap of timed actions, run in time order (ties: in the order they
were scheduled), with nothing but a float for "now".

    at(t, fn, *args) ──▶ heap of (t, seq, fn, args) ──▶ run(until): pop, now = t, fn(*args)

An action may schedule more actions; one scheduled in the past runs at once (its time is
raised to now), so the clock never moves backwards.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

Action = Callable[..., None]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.processed = 0  # actions run so far
        self._heap: list[tuple[float, int, Action, tuple[Any, ...]]] = []
        self._seq = 0

    def at(self, time: float, action: Action, *args: Any) -> None:
        """Runs ``action(*args)`` at ``time`` (or now, if that has passed)."""
        self._seq += 1
        heapq.heappush(self._heap, (max(time, self.now), self._seq, action, args))

    def after(self, delay_seconds: float, action: Action, *args: Any) -> None:
        self.at(self.now + delay_seconds, action, *args)

    @property
    def pending(self) -> int:
        return len(self._heap)

    def run(self, until: float = float("inf")) -> None:
        """Runs every action due at or before ``until``; ``now`` ends at ``until`` when that is
        finite, else at the last action run."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            time, _, action, args = heapq.heappop(heap)
            self.now = time
            self.processed += 1
            action(*args)
        if until != float("inf"):
            self.now = max(self.now, until)
