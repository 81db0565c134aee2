"""How much KV the connector's writer persisted (and how many blocks it loaded), carried out of vLLM's engine-core process.

The writer thread lives beside the model runner, in the engine-core process; the metrics live
in the worker process. vLLM already carries a connector's stats across that boundary: the
model runner asks `get_kv_connector_stats()` after every step, the scheduler puts the dict in
`SchedulerStats.kv_connector_stats`, and the worker's stat logger receives it. Each report
holds what Redis confirmed since the previous one, so the receiver adds them up; a write that
lands after the last step of a burst is reported with the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from worker.constants import REJECTED_REQUEST_PREFIXES

WRITTEN_BLOCKS = "written_blocks"
WRITTEN_BYTES = "written_bytes"
DROPPED_BLOCKS = "dropped_blocks"
# Blocks a resume had without computing them: loaded from a migration's staging memory or
# from Redis, or found in vLLM's prefix cache (warmed there during the migration handshake).
LOADED_STAGED_BLOCKS = "loaded_staged_blocks"
LOADED_STORE_BLOCKS = "loaded_store_blocks"
CACHED_BLOCKS = "cached_blocks"
# Stored blocks a resume refused because their MAC failed (recomputed instead).
MAC_REJECTED_BLOCKS = "mac_rejected_blocks"
# Full blocks the hybrid policy's rate cap held back in the step they filled (from the
# scheduler role): saved in a later step as the cap allows, or at the pause.
DEFERRED_BLOCKS = "deferred_blocks"
# The same per request ("<MAC_REJECTED_REQUEST_PREFIX><request id>" → blocks; and
# LAYOUT_REJECTED_REQUEST_PREFIX for blocks another layout wrote), from the
# scheduler role, which finds them before the request's first step, so the resume's event can
# say it (worker/engine_stats.py).
KEYS = (
    WRITTEN_BLOCKS,
    WRITTEN_BYTES,
    DROPPED_BLOCKS,
    LOADED_STAGED_BLOCKS,
    LOADED_STORE_BLOCKS,
    CACHED_BLOCKS,
    MAC_REJECTED_BLOCKS,
    DEFERRED_BLOCKS,
)


@dataclass
class PersistStats(KVConnectorStats):
    """Counts since the previous report, one int per key of `KEYS`."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in KEYS:
            self.data[key] = int(self.data.get(key, 0)) + int(other.data.get(key, 0))
        for key, value in other.data.items():
            if key.startswith(REJECTED_REQUEST_PREFIXES):
                self.data[key] = int(self.data.get(key, 0)) + int(value)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: int(self.data.get(key, 0)) for key in KEYS}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class PersistReporter:
    """Turns the writer's running totals into per-report differences."""

    def __init__(self) -> None:
        self._reported = dict.fromkeys(KEYS, 0)

    def report(self, totals: dict[str, int]) -> PersistStats | None:
        """``totals``: running totals of some of `KEYS` (the scheduler role counts others)."""
        delta = {key: totals.get(key, 0) - self._reported[key] for key in KEYS}
        if not any(delta.values()):
            return None
        self._reported = {key: totals.get(key, 0) for key in KEYS}
        return PersistStats(data=delta)


def persist_stats_from(data: dict[str, Any] | None) -> PersistStats | None:
    return PersistStats(data=dict(data)) if data else None
