"""The registry's clock: time during which this coordinator was listening.

A worker is LOST after a silence (no heartbeat answer, no lease renewal) measured on the
coordinator's clock. When the coordinator itself stalls — its event loop starved of CPU,
or blocked — the answers and renewals wait unread in its sockets, and on waking it would
find every worker silent at once and give up on all of them together (a busy 2-core CI box
did exactly that: every node lost, every stream with it). The silence was the coordinator's,
not the workers'.

    monotonic ──┬──tick──tick──tick──┐ stall ┌──tick──tick──▶
                │                    └───────┘
    attentive ──┴──tick──tick──tick──────────tick──tick──▶   (the stall left out)

A ticker on the loop wakes every TICK_SECONDS; a wake later than that by more than
STALL_TOLERANCE_SECONDS is a stall, and the lateness is left out of this clock. A reading
taken before the ticker has caught up (the first callback after the stall may be a state
refresh) counts the stall in progress the same way. Without a running ticker (unit tests,
or before the loop starts) it is plain ``time.monotonic``.

A dead worker is still found: its silence is counted in attentive time, so it is found
later by at most the time the coordinator was not listening.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

TICK_SECONDS = 0.2
STALL_TOLERANCE_SECONDS = 0.3  # lateness that is only scheduling noise
STALL_LOG_SECONDS = 1.0  # a stall this long is worth a line in the log


class AttentiveClock:
    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._stalled_seconds = 0.0
        self._last_tick: float | None = None  # None: no ticker running
        self._task: asyncio.Task[None] | None = None

    def __call__(self) -> float:
        now = self._monotonic()
        if self._last_tick is not None:
            self._account(now)
        return now - self._stalled_seconds

    @property
    def stalled_seconds(self) -> float:
        """The total left out so far."""
        return self._stalled_seconds

    def _account(self, now: float) -> None:
        assert self._last_tick is not None
        late = now - self._last_tick - TICK_SECONDS
        if late > STALL_TOLERANCE_SECONDS:
            self._stalled_seconds += late
            self._last_tick = now
            level = logging.WARNING if late >= STALL_LOG_SECONDS else logging.DEBUG
            log.log(
                level, "the coordinator stalled for %.1f s; not counted as workers' silence", late
            )

    def tick(self) -> None:
        """One wake of the ticker (the loop calls it; tests may too)."""
        now = self._monotonic()
        if self._last_tick is not None:
            self._account(now)
        self._last_tick = now

    def start(self) -> None:
        self.tick()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="attentive-clock")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._last_tick = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            self.tick()
