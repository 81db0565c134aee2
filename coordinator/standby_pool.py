"""The warm-standby pool: workers registered as STANDBY, weights loaded, taking no new request
until one is promoted — when no active worker is left to route to, or a failover needs a
target. Fewer ready standbys than wanted is said loudly, once per change.

Standbys are kept spread over the pools the fleet registers (zone, instance type, purchase
option): the one promoted comes from the pool that has the most, so the ones left stay
spread, and a wave that takes one pool does not take every standby. All ready standbys in
one pool while the fleet has several is said loudly too."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

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

    def promote_one(
        self,
        exclude: frozenset[str] = frozenset(),
        where: Callable[[WorkerEntry], bool] | None = None,
    ) -> WorkerEntry | None:
        """Makes one ready standby ACTIVE (not in ``exclude``, and one ``where`` accepts) and
        returns it: from the pool with the most ready standbys. None if there is none (and a
        warning when any standby would have done)."""
        ready = self._registry.ready_standbys()
        per_pool = collections.Counter(e.pool.name for e in ready)
        candidates = [e for e in ready if e.address not in exclude and (where is None or where(e))]
        if not candidates:
            if where is None:
                log.warning("no warm standby to promote: the standby pool is empty")
            return None
        entry = max(candidates, key=lambda e: per_pool[e.pool.name])  # the first of a tie
        self._registry.promote(entry)
        self.check()
        return entry

    def check(self) -> None:
        """Logs when the pool is below its wanted size, or all in one pool of several (only
        when the count changes)."""
        ready = self.ready
        if ready == self._last_reported:
            return
        self._last_reported = ready
        pools = {e.pool.name for e in self._registry}
        standby_pools = {e.pool.name for e in self._registry.ready_standbys()}
        if ready > 1 and len(standby_pools) == 1 and len(pools) > 1:
            log.warning(
                "every ready standby is in pool %s: a wave that takes that pool takes them all",
                next(iter(standby_pools)),
            )
        if ready < self._wanted:
            log.warning(
                "standby pool below target: %d of %d warm standbys ready%s",
                ready,
                self._wanted,
                " — THE POOL IS EMPTY" if ready == 0 else "",
            )
        elif self._wanted:
            log.info("standby pool: %d of %d warm standbys ready", ready, self._wanted)
