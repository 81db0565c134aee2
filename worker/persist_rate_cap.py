"""The ``hybrid`` policy's cap on KV persistence: a token bucket that decides, each engine
step, how many of the full blocks not yet stored go to Redis now.

Which blocks: a resume can use only a request's stored prefix (the hash chain runs from block
0, and the first missing block ends what it loads), so each request's blocks are saved in
order and a block held back stays ahead of that request's later ones. Across requests the
budget goes one block at a time to the request with the most full blocks not stored: the one
an abrupt loss would make recompute the longest, so the backlogs even out and the worst
recompute after a loss stays as small as the cap allows. What is held back when a notice
comes is saved at the pause, as under ``lazy``: a notice still costs no recompute.

    one step:  bucket += rate × seconds since the last step   (at most the burst)
               budget  = ⌊bucket / block bytes⌋ blocks

               request A  ■■□□□     ■ stored   □ full, not stored
               request B  ■□□
               budget 3   →  A (3 left); A (2 left, ties with B: A was scheduled first);
                             B (2 left, A has 1)
               after      A ■■■■□   B ■■□
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence

from worker.constants import PERSIST_RATE_BURST_SECONDS


class PersistRateCap:
    """At most ``bytes_per_second`` of blocks of ``block_bytes`` each (every rank's shards),
    with a burst of ``burst_seconds`` of the rate (at least one block). The bucket starts
    full. Not thread-safe: the scheduler's one thread calls it."""

    def __init__(
        self,
        bytes_per_second: float,
        block_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        burst_seconds: float = PERSIST_RATE_BURST_SECONDS,
    ) -> None:
        assert bytes_per_second > 0, "the config refuses a cap that is not positive"
        assert block_bytes > 0, "a stored block holds bytes"
        self.bytes_per_second = bytes_per_second
        self._block_bytes = block_bytes
        self._burst_bytes = max(float(block_bytes), bytes_per_second * burst_seconds)
        self._clock = clock
        self._bucket_bytes = self._burst_bytes
        self._refilled_at = clock()

    def grant(self, backlogs: Sequence[int]) -> list[int]:
        """``backlogs``: per request, its full blocks not stored yet (in the order the step
        scheduled them). Returns, per request, how many of them (its leading ones) to save
        now; what it grants is taken from the bucket."""
        now = self._clock()
        elapsed = max(0.0, now - self._refilled_at)
        self._refilled_at = now
        self._bucket_bytes = min(
            self._burst_bytes, self._bucket_bytes + elapsed * self.bytes_per_second
        )
        budget = min(int(self._bucket_bytes // self._block_bytes), sum(backlogs))
        granted = [0] * len(backlogs)
        # Most blocks left first; a tie goes to the request scheduled first.
        waiting = [(-left, position) for position, left in enumerate(backlogs) if left > 0]
        heapq.heapify(waiting)
        for _ in range(budget):
            negative_left, position = heapq.heappop(waiting)
            granted[position] += 1
            if negative_left < -1:
                heapq.heappush(waiting, (negative_left + 1, position))
        self._bucket_bytes -= budget * self._block_bytes
        return granted
