"""Wall-clock time for watchers, injected so tests can move time without sleeping."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Unix seconds now."""
        ...


class SystemClock:
    def time(self) -> float:
        return time.time()
