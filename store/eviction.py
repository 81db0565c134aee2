"""A store that may evict keys is refused at start.

Every request record and block carries a TTL, so under memory pressure any evicting
`maxmemory-policy` can take one: `allkeys-*` any key, `volatile-*` any key with a TTL — a
running request's record included, which would lose the request. Only `noeviction` (Redis
then refuses writes when full, which the processes see and degrade on) is safe. A server
without a memory limit (`maxmemory` 0) evicts nothing whatever its policy; that is logged,
not refused, since a limit set later would start evicting.

    process start ─▶ INFO memory on the server (every master of a cluster)
        policy noeviction ─────────────────────▶ start
        evicting policy, maxmemory 0 ──────────▶ warn, start
        evicting policy, maxmemory > 0 ────────▶ EvictingStore: refuse to start
        Redis unreachable / INFO not allowed ──▶ warn, start (checked once, not again)
"""

from __future__ import annotations

import logging

from store.errors import EvictingStore, StoreError, StoreUnavailable
from store.redis_link import RedisLink

log = logging.getLogger(__name__)

SAFE_POLICY = "noeviction"


def check_eviction_policy(link: RedisLink, url: str) -> None:
    """Raises EvictingStore when a node of the store on ``url`` may evict keys; logs and
    returns when it cannot tell (unreachable, or INFO refused)."""
    try:
        settings = link.memory_settings()
    except StoreUnavailable as exc:
        log.warning("could not check Redis's eviction policy (unreachable): %s", exc)
        return
    except StoreError as exc:
        log.warning("could not check Redis's eviction policy: %s", exc)
        return
    for node, policy, maxmemory in settings:
        if policy == SAFE_POLICY:
            continue
        if maxmemory > 0:
            raise EvictingStore(
                f"Redis at {url} ({node}) has maxmemory-policy {policy} with maxmemory "
                f"{maxmemory} bytes: under memory pressure it would evict request records "
                f"(they all carry TTLs, so volatile-* policies take them too). Set "
                f"maxmemory-policy {SAFE_POLICY} (ElastiCache / Memorystore: the parameter "
                "group's or instance's maxmemory-policy)"
            )
        log.warning(
            "Redis at %s (%s) has maxmemory-policy %s but no maxmemory: nothing is evicted "
            "now, but a memory limit set later would evict request records",
            url,
            node,
            policy,
        )
