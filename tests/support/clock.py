"""A clock a test moves by hand, for code that takes ``clock: Callable[[], float]``."""

from __future__ import annotations


class ManualClock:
    """Call it for the time; `advance` moves it. Starts at ``start`` (seconds)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "time does not go back"
        self.now += seconds
