"""The warm-standby pool: workers registered as STANDBY, weights loaded, taking no new request
until one is promoted — when no active worker is left to route to, or a failover needs a
target. Fewer ready standbys than wanted is said loudly, once per change."""

from __future__ import annotations

import logging

from coordinator.registry import Registry, WorkerEntry

log = logging.getLogger(__name__)


class StandbyPool:
    def __init__(self, registry: Registry, wanted: int) -> None:
        self._registry = registry
        self._wanted = wanted
        self._last_reported: int | None = None

    @property
    def wanted(self) -> int:
        return self._wanted

    @property
    def ready(self) -> int:
        return len(self._registry.ready_standbys())

    def promote_one(self, exclude: frozenset[str] = frozenset()) -> WorkerEntry | None:
        """Makes one ready standby ACTIVE and returns it; None (and a warning) if none is."""
        for entry in self._registry.ready_standbys():
            if entry.address not in exclude:
                self._registry.promote(entry)
                self.check()
                return entry
        log.warning("no warm standby to promote: the standby pool is empty")
        return None

    def check(self) -> None:
        """Logs when the pool is below its wanted size (only when the count changes)."""
        ready = self.ready
        if ready == self._last_reported:
            return
        self._last_reported = ready
        if ready < self._wanted:
            log.warning(
                "standby pool below target: %d of %d warm standbys ready%s",
                ready,
                self._wanted,
                " — THE POOL IS EMPTY" if ready == 0 else "",
            )
        elif self._wanted:
            log.info("standby pool: %d of %d warm standbys ready", ready, self._wanted)
