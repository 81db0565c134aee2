"""The heartbeat: every interval, each worker's Stats, all workers at once.

An answer refreshes the worker's capacity; no answer leaves its last heartbeat where it was,
and `Registry.refresh` turns a silence longer than `lost_after_seconds` into LOST. The loop
logs and survives any error: it is what notices a dead worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from coordinator.registry import Registry, WorkerEntry

log = logging.getLogger(__name__)


class Heartbeat:
    """``after_beat`` runs after each round (admission retries its queues then)."""

    def __init__(
        self,
        registry: Registry,
        interval_seconds: float,
        after_beat: Callable[[], None] = lambda: None,
    ) -> None:
        self._registry = registry
        self._interval_seconds = interval_seconds
        self._after_beat = after_beat
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="heartbeat")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def beat(self) -> None:
        """One round: ask every worker, then derive states."""
        entries = list(self._registry)
        await asyncio.gather(*(self._ask(entry) for entry in entries))
        self._registry.refresh()
        self._after_beat()

    async def _ask(self, entry: WorkerEntry) -> None:
        asked_monotonic = self._registry.now()
        try:
            capacity = await entry.client.stats()
        except grpc.aio.AioRpcError as exc:
            log.debug("worker %s did not answer Stats: %s", entry.worker_id, exc.code().name)
            return
        self._registry.record_heartbeat(entry, capacity, asked_monotonic)

    async def _loop(self) -> None:
        while True:
            try:
                await self.beat()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop that notices dead workers must not die itself
                log.exception("heartbeat round failed")
            await asyncio.sleep(self._interval_seconds)
