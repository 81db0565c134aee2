"""Request records of the coordinator in Redis: who serves a request, how far it got.

A restarted coordinator (or a second one on the same Redis) finds a request's owner and the
number of tokens its clients were given here. Writes go behind the stream, batched in one
pipeline per flush, so relaying a token never waits for Redis; a Redis outage only loses
record updates, never a stream. The key is `keys.request_route_key` (one HASH per request).

A running request's record lives `ttl_seconds` from its last update (long: a request may run
for hours); a finished one only `retention_seconds` (short), so nothing of a finished request
stays in Redis for long.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from store.keys import request_route_key
from store.redis_link import security_options, translate_errors
from store.store_config import StoreConfig

log = logging.getLogger(__name__)

FINISHED_STATUS = "finished"  # RelayStatus.FINISHED's value, as records spell it


@dataclass(frozen=True)
class RouteRecord:
    request_id: str
    coordinator_id: str
    owner_worker_id: str
    status: str  # queued | running | switching | finished
    finish_reason: str  # FinishReason name; NONE while it runs
    delivered_length: int
    sla_class: str
    updated_unix_ms: int
    coordinator_address: str = ""  # host:port of the relaying coordinator's gRPC front

    def to_fields(self) -> dict[str, str | int]:
        return {
            "request_id": self.request_id,
            "coordinator_id": self.coordinator_id,
            "owner_worker_id": self.owner_worker_id,
            "status": self.status,
            "finish_reason": self.finish_reason,
            "delivered_length": self.delivered_length,
            "sla_class": self.sla_class,
            "updated_unix_ms": self.updated_unix_ms,
            "coordinator_address": self.coordinator_address,
        }

    @classmethod
    def from_fields(cls, fields: Mapping[Any, Any]) -> RouteRecord:
        def text(name: str) -> str:
            value = fields[name.encode()]
            return value.decode() if isinstance(value, bytes) else str(value)

        return cls(
            request_id=text("request_id"),
            coordinator_id=text("coordinator_id"),
            owner_worker_id=text("owner_worker_id"),
            status=text("status"),
            finish_reason=text("finish_reason"),
            delivered_length=int(text("delivered_length")),
            sla_class=text("sla_class"),
            updated_unix_ms=int(text("updated_unix_ms")),
            coordinator_address=text("coordinator_address")
            if b"coordinator_address" in fields
            else "",
        )


class RouteLookup(Protocol):
    """Where adoption finds a request's route (RouteRecords; a dict in unit tests)."""

    async def get(self, request_id: str) -> RouteRecord | None: ...


class RouteRecords:
    """Write-behind store of RouteRecords. `note` is cheap; `flush` (every interval, and at
    stop) writes the latest version of each noted record."""

    def __init__(
        self,
        client: aioredis.Redis | aioredis.RedisCluster,
        ttl_seconds: int,
        retention_seconds: float,
        flush_interval_seconds: float,
    ) -> None:
        self._client = client
        self._ttl_ms = int(ttl_seconds * 1000)
        self._retention_ms = max(1, int(retention_seconds * 1000))
        self._flush_interval_seconds = flush_interval_seconds
        self._pending: dict[str, RouteRecord] = {}
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def from_url(
        cls,
        url: str,
        ttl_seconds: int,
        retention_seconds: float,
        flush_interval_seconds: float,
        store_config: StoreConfig | None = None,
    ) -> RouteRecords:
        """Records on ``url``, logged in and verified as ``store_config`` says (TLS, ACL user;
        a Redis Cluster client, which sends each record to its slot's master, when it names
        a cluster)."""
        options = security_options(url, store_config) if store_config is not None else {}
        cluster = store_config is not None and store_config.cluster
        client_type = aioredis.RedisCluster if cluster else aioredis.Redis
        return cls(
            client_type.from_url(url, **options),
            ttl_seconds,
            retention_seconds,
            flush_interval_seconds,
        )

    def note(self, record: RouteRecord) -> None:
        self._pending[record.request_id] = record

    async def get(self, request_id: str) -> RouteRecord | None:
        """The request's record, None when it has none; StoreUnavailable (UNAVAILABLE to a
        client, who attaches again) when Redis does not answer, StoreError when it refuses."""
        with translate_errors():
            fields = await self._client.hgetall(request_route_key(request_id))  # type: ignore[misc]
        return RouteRecord.from_fields(fields) if fields else None

    async def flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, {}
        async with self._client.pipeline(transaction=False) as pipe:
            for record in batch.values():
                key = request_route_key(record.request_id)
                pipe.hset(key, mapping=record.to_fields())  # type: ignore[arg-type]
                finished = record.status == FINISHED_STATUS
                pipe.pexpire(key, self._retention_ms if finished else self._ttl_ms)
            try:
                await pipe.execute()
            except RedisError as exc:
                log.warning("request records not written (%d): %s", len(batch), exc)
                for request_id, record in batch.items():
                    self._pending.setdefault(request_id, record)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="route-records")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.flush()
        await self._client.aclose()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._flush_interval_seconds)
            try:
                await self.flush()
            except Exception:  # keep writing records whatever one flush met
                log.exception("request record flush failed")


def now_unix_ms() -> int:
    return int(time.time() * 1000)
