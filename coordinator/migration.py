"""Live migration on a termination notice, the coordinator's part.

The worker does the pausing and the persisting (Worker.Preempt, called by its context
daemon); the coordinator learns of the notice, stops routing to the worker, and moves each
paused request once its state is complete in the store::

    daemon WatchNotices ──notice──▶ Migrations.noticed ─▶ worker PREEMPTED (no new routing)
    Control.InjectNotice ─────────▶   └─ (drill) daemon.Flush(deadline) ─┐
                                                                        ▼
    worker: pause at an iteration boundary, persist tokens + full blocks + partial tail
      │ the request's stream ends with a NOTICE event       │ one FlushReport per request
      ▼                                                     ▼
    Relay ─▶ FailoverPolicy.take_over ─▶ Migrations.wait_flushed(request) ◀─ flushed(report)
                    │ complete (or the source died / the deadline passed: recovery instead)
                    ▼
    Admission.requeue (a worker with room, a promoted standby, or wait) ─▶ Worker.Resume
    from the client's next index: MIGRATED event, nothing recomputed

Resuming before the report would race the flush (the tail block and the PAUSED mark land
after the stream ends), so the wait is what makes the recompute zero. A source that dies
mid-flush wakes the waiters at once; Worker.Resume then recovers from what the store holds.

Not here yet: the multi-stage handshake of DESIGN.md (the target pre-allocates and
prefetches full blocks while the source still decodes). Today the target loads every block
from Redis after the pause.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import grpc

from context_daemon.worker_link import FlushReport
from coordinator.constants import (
    DAEMON_RESUBSCRIBE_SECONDS,
    FLUSH_REPORT_KEEP_SECONDS,
    FLUSH_WAIT_MARGIN_SECONDS,
    FLUSH_WAIT_WITHOUT_DAEMON_SECONDS,
    NOTICE_DEFAULT_GRACE_SECONDS,
)
from coordinator.daemon_client import DaemonClient, DaemonEvent
from coordinator.registry import Registry, WorkerEntry, WorkerState

log = logging.getLogger(__name__)

# States in which a worker can no longer finish a flush.
_GONE = frozenset({WorkerState.LOST, WorkerState.STOPPED})


@dataclass
class _Waiter:
    address: str
    future: asyncio.Future[FlushReport | None]


class Migrations:
    """Notices, daemon subscriptions and flush reports. Not thread-safe: the coordinator's
    event loop owns it. ``clock`` returns unix seconds (notice deadlines are unix times)."""

    def __init__(
        self,
        registry: Registry,
        daemon_factory: Callable[[str], DaemonClient] = DaemonClient,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._registry = registry
        self._daemon_factory = daemon_factory
        self._clock = clock
        self._daemons: dict[str, DaemonClient] = {}  # by worker address
        self._tasks: set[asyncio.Task[None]] = set()
        self._deadlines: dict[str, float] = {}  # notice deadline by worker address
        self._reports: dict[tuple[str, str], tuple[FlushReport, float]] = {}
        self._waiters: dict[tuple[str, str], _Waiter] = {}
        registry.subscribe(self._on_worker_state)

    # -- notices -----------------------------------------------------------------------

    def watch(self, entry: WorkerEntry) -> None:
        """Subscribes to the worker's daemon, if it has one (once per worker)."""
        if not entry.daemon_address or entry.address in self._daemons:
            return
        daemon = self._daemon_factory(entry.daemon_address)
        self._daemons[entry.address] = daemon
        self._spawn(self._follow(entry, daemon), f"notices-{entry.address}")

    def noticed(self, entry: WorkerEntry, deadline_unix: float) -> None:
        """The worker's VM ends at ``deadline_unix``: route nothing new to it."""
        known = self._deadlines.get(entry.address)
        self._deadlines[entry.address] = min(known, deadline_unix) if known else deadline_unix
        if entry.state in _GONE or entry.orchestrated_state == WorkerState.PREEMPTED:
            return
        log.warning(
            "termination notice for worker %s: %.1f s left; no new requests go there",
            entry.worker_id,
            deadline_unix - self._clock(),
        )
        self._registry.set_orchestrated_state(entry, WorkerState.PREEMPTED)

    def inject(self, entry: WorkerEntry, grace_seconds: float, flush: bool) -> float:
        """A drill's notice: the worker is PREEMPTED and, when ``flush`` and it has a daemon,
        the daemon flushes it by now + ``grace_seconds``. Returns the deadline."""
        deadline_unix = self._clock() + grace_seconds
        self.noticed(entry, deadline_unix)
        daemon = self._daemons.get(entry.address)
        if not flush:
            return deadline_unix
        if daemon is None:
            log.warning(
                "worker %s has no context daemon registered: it is only taken out of routing "
                "(its requests run on until it goes)",
                entry.worker_id,
            )
            return deadline_unix
        self._spawn(self._flush(entry, daemon, deadline_unix, grace_seconds), "flush")
        return deadline_unix

    def flushed(self, address: str, report: FlushReport) -> None:
        """One paused request's flush report (idempotent: Flush and WatchNotices both give it)."""
        key = (address, report.request_id)
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.future.done():
            waiter.future.set_result(report)
            return
        now = time.monotonic()
        for old_key, (_, at) in list(self._reports.items()):
            if now - at > FLUSH_REPORT_KEEP_SECONDS:
                del self._reports[old_key]
        self._reports[key] = (report, now)

    # -- the relay's side ----------------------------------------------------------------

    async def wait_flushed(self, request_id: str, entry: WorkerEntry) -> FlushReport | None:
        """The flush report of ``request_id``, paused on ``entry``; None when none will come
        (the worker died, or the deadline passed without a report)."""
        key = (entry.address, request_id)
        stored = self._reports.pop(key, None)
        if stored is not None:
            return stored[0]
        if entry.state in _GONE:
            return None
        future: asyncio.Future[FlushReport | None] = asyncio.get_running_loop().create_future()
        self._waiters[key] = _Waiter(entry.address, future)
        try:
            return await asyncio.wait_for(future, self._wait_seconds(entry))
        except TimeoutError:
            log.warning(
                "request %s: no flush report from worker %s in time", request_id, entry.worker_id
            )
            return None
        finally:
            self._waiters.pop(key, None)

    def _wait_seconds(self, entry: WorkerEntry) -> float:
        if entry.address not in self._daemons:
            # Nobody will report; give the worker's own flush a moment to land.
            return FLUSH_WAIT_WITHOUT_DAEMON_SECONDS
        deadline = self._deadlines.get(entry.address)
        if deadline is None:  # the stream ended before the notice reached us
            return NOTICE_DEFAULT_GRACE_SECONDS + FLUSH_WAIT_MARGIN_SECONDS
        return max(0.0, deadline - self._clock()) + FLUSH_WAIT_MARGIN_SECONDS

    def _on_worker_state(self, entry: WorkerEntry, old: WorkerState, new: WorkerState) -> None:
        if new not in _GONE:
            return
        for key, waiter in list(self._waiters.items()):
            if waiter.address == entry.address and not waiter.future.done():
                log.warning(
                    "worker %s is %s before request %s was flushed: recovering it instead",
                    entry.worker_id,
                    new.value,
                    key[1],
                )
                waiter.future.set_result(None)

    # -- background calls ----------------------------------------------------------------

    async def _follow(self, entry: WorkerEntry, daemon: DaemonClient) -> None:
        """The daemon's notices and reports, re-subscribing whenever the stream breaks."""
        while True:
            try:
                async for event in daemon.watch(on_subscribed=lambda: _subscribed(entry)):
                    self._on_event(entry, event)
            except grpc.aio.AioRpcError as exc:
                log.debug("daemon of %s: %s", entry.worker_id, exc.code().name)
            except Exception:  # the subscription must outlive any one bad event
                log.exception("daemon subscription of %s failed", entry.worker_id)
            entry.notices_watched = False
            await asyncio.sleep(DAEMON_RESUBSCRIBE_SECONDS)

    def _on_event(self, entry: WorkerEntry, event: DaemonEvent) -> None:
        if event.flush is not None:
            self.flushed(entry.address, event.flush)
        elif event.ends_vm:
            deadline = event.deadline_unix or self._clock() + NOTICE_DEFAULT_GRACE_SECONDS
            self.noticed(entry, deadline)
        else:
            log.info("worker %s: %s hint from %s", entry.worker_id, event.action, event.source)

    async def _flush(
        self, entry: WorkerEntry, daemon: DaemonClient, deadline_unix: float, grace: float
    ) -> None:
        try:
            async for report in daemon.flush(deadline_unix, grace + FLUSH_WAIT_MARGIN_SECONDS):
                self.flushed(entry.address, report)
        except grpc.aio.AioRpcError as exc:
            log.warning("flush through the daemon of %s failed: %s", entry.worker_id, exc)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for daemon in self._daemons.values():
            await daemon.close()


def _subscribed(entry: WorkerEntry) -> None:
    log.info("watching the notices of worker %s", entry.worker_id)
    entry.notices_watched = True
