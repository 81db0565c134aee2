"""Live migration on a termination notice, the coordinator's part: a staged handshake.

The worker pauses and persists (Worker.Preempt, called by its context daemon); the target
prefetches (Worker.Prefetch); the coordinator runs the handshake between them::

    daemon WatchNotices ──notice──▶ Migrations.noticed ─▶ worker PREEMPTED (no new routing)
    Control.InjectNotice ─────────▶   │ (the daemon waits for our Flush: we said we orchestrate)
                                      ▼
    stage 1..n, per request, while the source still decodes:
      Admission.reserve (a target with room, or a promoted standby)
      target.Prefetch ×n: the persisted full blocks, then what the source filled since,
      until a stage finds nothing new (or the stage budget is spent); the target loads each
      stage's blocks into its vLLM cache at once (a one-token warm-up request)
                                      ▼
    last stage: daemon.Flush ─▶ source pauses every request at an iteration boundary and
      persists its token tail and partial block ─▶ one FlushReport per request
                                      ▼
    Relay ─▶ FailoverPolicy.take_over ─▶ wait_flushed ─▶ take_prepared (the reserved target)
      ─▶ Worker.Resume there: the staged blocks are already in its cache, the tail comes
         from Redis; MIGRATED

Only the partial block and the newest tokens move during the pause, so it does not grow with
the context. The handshake aborts cleanly, freeing the reservation and the staged blocks
(DropPrefetch): when the request finishes meanwhile, when the target refuses (no staging room,
no store, draining) or dies, when the stage budget runs out before a stage answers. A request
without a prepared move (no room anywhere, or an aborted handshake) moves the plain way once
paused: requeued, and resumed from the store. A source that dies mid-way wakes the flush
waiters at once; Worker.Resume then recovers from what the store holds (on the prepared
target when there is one).

Resuming before the flush report would race the flush (the tail block and the PAUSED mark
land after the stream ends), so that wait is what makes the recompute zero.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from common.messages import FlushReport, NoticeEvent
from common.requests import GenerationRequest
from coordinator.admission import Admission, Lease
from coordinator.constants import (
    DAEMON_RESUBSCRIBE_SECONDS,
    FLUSH_REPORT_KEEP_SECONDS,
    FLUSH_WAIT_MARGIN_SECONDS,
    FLUSH_WAIT_WITHOUT_DAEMON_SECONDS,
    LOST_WORKER_SETTLE_SECONDS,
    NOTICE_DEFAULT_GRACE_SECONDS,
    PREFETCH_TIMEOUT_SECONDS,
    STAGING_CONCURRENCY,
    STAGING_MAX_SECONDS,
    STAGING_MAX_SHARE,
    STAGING_MAX_STAGES,
    STAGING_MIN_LEFT_SECONDS,
)
from coordinator.daemon_client import DaemonClient, DaemonEndpoint
from coordinator.registry import Registry, WorkerEntry, WorkerState
from coordinator.worker_client import PrefetchRefused

log = logging.getLogger(__name__)

# States in which a worker can no longer finish a flush.
_GONE = frozenset({WorkerState.LOST, WorkerState.STOPPED})


@dataclass
class _Waiter:
    address: str
    future: asyncio.Future[FlushReport | None]


class MovingRequest(Protocol):
    """What staging needs of an in-flight request (the relay)."""

    @property
    def request(self) -> GenerationRequest: ...

    @property
    def finished(self) -> bool: ...

    @property
    def delivered_tokens(self) -> int: ...


@dataclass
class PreparedMove:
    """A request staged on its target while its source still decodes."""

    request_id: str
    source_address: str
    lease: Lease
    staged_blocks: int = 0
    staged_bytes: int = 0
    stages: int = 0


class Migrations:
    """Notices, daemon subscriptions and flush reports. Not thread-safe: the coordinator's
    event loop owns it. ``clock`` returns unix seconds (notice deadlines are unix times)."""

    def __init__(
        self,
        registry: Registry,
        daemon_factory: Callable[[str], DaemonEndpoint] = DaemonClient,
        clock: Callable[[], float] = time.time,
        migrate_on_rebalance: bool = False,
    ) -> None:
        self._registry = registry
        self.migrate_on_rebalance = migrate_on_rebalance
        self._daemon_factory = daemon_factory
        self._clock = clock
        self._daemons: dict[str, DaemonEndpoint] = {}  # by worker address
        self._settling: dict[str, asyncio.Task[None]] = {}  # by worker address
        self._tasks: set[asyncio.Task[None]] = set()
        self._deadlines: dict[str, float] = {}  # notice deadline by worker address
        self._reports: dict[tuple[str, str], tuple[FlushReport, float]] = {}
        self._waiters: dict[tuple[str, str], _Waiter] = {}
        # Staged migration, once enabled (a failover policy that moves paused requests).
        self._admission: Admission | None = None
        self._requests_on: Callable[[str], Sequence[MovingRequest]] = lambda address: ()
        self._moves: dict[str, PreparedMove] = {}  # by request id
        self._evacuating: set[str] = set()  # worker addresses
        registry.subscribe(self._on_worker_state)

    def enable_staging(
        self, admission: Admission, requests_on: Callable[[str], Sequence[MovingRequest]]
    ) -> None:
        """Noticed workers' requests are staged on their targets before the pause;
        ``requests_on(address)`` lists the unfinished requests a worker serves."""
        self._admission = admission
        self._requests_on = requests_on

    @property
    def orchestrates(self) -> bool:
        """Whether this coordinator stages migrations (and so calls the daemons' Flush)."""
        return self._admission is not None

    # -- notices -----------------------------------------------------------------------

    def watch(self, entry: WorkerEntry) -> None:
        """Subscribes to the worker's daemon, if it has one (once per worker)."""
        if not entry.daemon_address or entry.address in self._daemons:
            return
        daemon = self._daemon_factory(entry.daemon_address)
        self._daemons[entry.address] = daemon
        self._spawn(self._follow(entry, daemon), f"notices-{entry.address}")

    async def settle_lost(self, entry: WorkerEntry) -> None:
        """Before a lost worker's requests resume elsewhere: its daemon, if it outlived the
        worker (a process crash, not the VM), finishes writing what the worker handed over
        (bounded by LOST_WORKER_SETTLE_SECONDS). One call per worker at a time, shared by
        every request that was on it."""
        if not entry.daemon_address:
            return
        task = self._settling.get(entry.address)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._settle(entry))
            self._settling[entry.address] = task
            task.add_done_callback(lambda _: self._settling.pop(entry.address, None))
        await asyncio.shield(task)

    async def _settle(self, entry: WorkerEntry) -> None:
        daemon = self._daemons.get(entry.address)
        owned = daemon is None
        if daemon is None:
            daemon = self._daemon_factory(entry.daemon_address)
        started = time.monotonic()
        try:
            settled = await daemon.settle(LOST_WORKER_SETTLE_SECONDS)
        except grpc.aio.AioRpcError as error:
            # The VM went with it (or the daemon persists nothing): resume from what is stored.
            log.info("worker %s's daemon did not settle (%s)", entry.worker_id, error.code())
            return
        finally:
            if owned:
                await daemon.close()
        log.info(
            "worker %s's daemon %s its hand-off in %.2f s",
            entry.worker_id,
            "settled" if settled else "did not finish",
            time.monotonic() - started,
        )

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
        daemon = self._daemons.get(entry.address)
        if self.orchestrates and daemon is not None and entry.address not in self._evacuating:
            self._evacuating.add(entry.address)
            self._spawn(self._evacuate(entry, daemon), f"evacuate-{entry.address}")

    def inject(self, entry: WorkerEntry, grace_seconds: float, flush: bool) -> float:
        """A drill's notice: the worker is PREEMPTED and, when ``flush`` and it has a daemon,
        its requests move by now + ``grace_seconds`` (staged first when this coordinator
        stages, then the daemon's Flush). Returns the deadline."""
        deadline_unix = self._clock() + grace_seconds
        daemon = self._daemons.get(entry.address)
        if flush and daemon is None:
            log.warning(
                "worker %s has no context daemon registered: it is only taken out of routing "
                "(its requests run on until it goes)",
                entry.worker_id,
            )
        staged = self.orchestrates and entry.address not in self._evacuating
        self.noticed(entry, deadline_unix)
        if flush and daemon is not None and not staged:
            self._spawn(self._flush(entry, daemon, deadline_unix), "flush")
        return deadline_unix

    def moving_requests(self, entry: WorkerEntry) -> int:
        """Unfinished requests on ``entry`` that a notice would move (0 unless staging)."""
        return sum(1 for m in self._requests_on(entry.address) if not m.finished)

    # -- staging -------------------------------------------------------------------------

    async def _evacuate(self, entry: WorkerEntry, daemon: DaemonEndpoint) -> None:
        """Stages every request of the noticed ``entry`` on its target, then has the daemon
        pause and flush them all (the last stage)."""
        try:
            deadline = self._deadlines.get(entry.address) or (
                self._clock() + NOTICE_DEFAULT_GRACE_SECONDS
            )
            left = deadline - self._clock()
            budget = min(STAGING_MAX_SECONDS, STAGING_MAX_SHARE * left)
            if left < STAGING_MIN_LEFT_SECONDS:
                budget = 0.0  # a short notice: the flush needs all of it
            moving = [m for m in self._requests_on(entry.address) if not m.finished]
            if moving and budget > 0:
                started = time.monotonic()
                limit = asyncio.Semaphore(STAGING_CONCURRENCY)
                await asyncio.gather(
                    *(self._stage(m, entry, started + budget, limit) for m in moving)
                )
                staged = [
                    self._moves[m.request.request_id]
                    for m in moving
                    if m.request.request_id in self._moves
                ]
                log.info(
                    "worker %s: %d of %d request(s) staged on their targets in %.0f ms "
                    "(%d blocks); pausing them",
                    entry.worker_id,
                    len(staged),
                    len(moving),
                    1000 * (time.monotonic() - started),
                    sum(move.staged_blocks for move in staged),
                )
            await self._flush(entry, daemon, deadline)
        finally:
            self._evacuating.discard(entry.address)

    async def _stage(
        self,
        moving: MovingRequest,
        source: WorkerEntry,
        until_monotonic: float,
        limit: asyncio.Semaphore,
    ) -> None:
        """The first stages of one request's handshake (see the module doc)."""
        assert self._admission is not None, "staging is enabled"
        request_id = moving.request.request_id
        async with limit:
            if moving.finished or request_id in self._moves:
                return
            lease = self._admission.reserve(
                moving.request, frozenset({source.address}), source.pool
            )
            if lease is None:
                log.warning(
                    "request %s: no worker has room to stage it on; it moves after the pause",
                    request_id,
                )
                return
            move = PreparedMove(request_id, source.address, lease)
            self._moves[request_id] = move
            try:
                while move.stages < STAGING_MAX_STAGES:
                    timeout = min(PREFETCH_TIMEOUT_SECONDS, until_monotonic - time.monotonic())
                    if timeout <= 0:
                        break
                    result = await lease.entry.client.prefetch(request_id, timeout)
                    move.stages += 1
                    new_blocks = result.new_blocks
                    move.staged_blocks, move.staged_bytes = (
                        result.staged_blocks,
                        result.staged_bytes,
                    )
                    if result.finished or moving.finished:
                        self.abandon(request_id, "it finished")
                        return
                    if not new_blocks or _blocks_behind(moving, move, source) < 1:
                        break  # the source filled no block since this stage read the store
            except PrefetchRefused as exc:
                if exc.unavailable and source.daemon_address and lease.entry.daemon_address:
                    # Its KV can still move daemon to daemon at the pause (the target's
                    # store is what failed): the target stays reserved.
                    log.warning(
                        "request %s: staging on %s stopped (%s); its KV moves peer to peer",
                        request_id,
                        lease.entry.worker_id,
                        exc,
                    )
                    return
                self.abandon(request_id, f"target {lease.entry.worker_id} refused: {exc}")
                return
            log.info(
                "request %s: %d blocks (%.1f MB) staged on %s in %d stage(s)",
                request_id,
                move.staged_blocks,
                move.staged_bytes / 1e6,
                lease.entry.worker_id,
                move.stages,
            )

    def take_prepared(self, request_id: str) -> Lease | None:
        """The reserved target of a staged request, for its Resume (None: no prepared move, or
        its target can no longer take it — the reservation and staged blocks are freed)."""
        move = self._moves.pop(request_id, None)
        if move is None:
            return None
        entry = move.lease.entry
        if entry.state in _GONE or entry.orchestrated_state == WorkerState.PREEMPTED:
            self._free(move, f"target {entry.worker_id} is no longer available")
            return None
        return move.lease

    def abandon(self, request_id: str, why: str) -> None:
        """Aborts a handshake: frees the reservation and the staged blocks (idempotent)."""
        move = self._moves.pop(request_id, None)
        if move is not None:
            self._free(move, why)

    def _free(self, move: PreparedMove, why: str) -> None:
        log.info("request %s: staged migration aborted (%s)", move.request_id, why)
        move.lease.release()
        if move.stages:
            self._spawn(self._drop(move), f"drop-{move.request_id}")

    async def _drop(self, move: PreparedMove) -> None:
        await move.lease.entry.client.drop_prefetch(move.request_id)

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
        stopping = entry.capacity.stopping_deadline_unix if entry.capacity is not None else 0.0
        if stopping > 0 and new not in _GONE:
            # Stopped by SIGTERM (a scale-in, a MIG delete, a shutdown): it says when it goes,
            # and its requests move as on a notice.
            self.noticed(entry, stopping)
        if new not in _GONE:
            if old in _GONE:  # back after all: listen to its daemon again
                self.watch(entry)
            return
        for request_id, move in list(self._moves.items()):
            if move.lease.entry.address == entry.address:  # a target died mid-handshake
                self.abandon(request_id, f"target {entry.worker_id} is {new.value}")
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

    async def _follow(self, entry: WorkerEntry, daemon: DaemonEndpoint) -> None:
        """The daemon's notices and reports, re-subscribing whenever the stream breaks."""
        while True:
            try:
                async for event in daemon.watch(
                    on_subscribed=lambda: _subscribed(entry), orchestrates=self.orchestrates
                ):
                    self._on_event(entry, event)
            except grpc.aio.AioRpcError as exc:
                log.debug("daemon of %s: %s", entry.worker_id, exc.code().name)
            except Exception:  # the subscription must outlive any one bad event
                log.exception("daemon subscription of %s failed", entry.worker_id)
            entry.notices_watched = False
            if entry.state in _GONE:  # its worker is gone: so is the reason to listen
                self._daemons.pop(entry.address, None)
                await daemon.close()
                return
            await asyncio.sleep(DAEMON_RESUBSCRIBE_SECONDS)

    def _on_event(self, entry: WorkerEntry, event: NoticeEvent) -> None:
        if event.flush is not None:
            self.flushed(entry.address, event.flush)
        elif event.ends_vm:
            deadline = event.deadline_unix or self._clock() + NOTICE_DEFAULT_GRACE_SECONDS
            self.noticed(entry, deadline)
        elif self.migrate_on_rebalance:
            log.warning(
                "worker %s: %s hint from %s; moving its requests before any notice",
                entry.worker_id,
                event.action,
                event.source,
            )
            self.inject(entry, NOTICE_DEFAULT_GRACE_SECONDS, flush=True)
        else:
            log.info("worker %s: %s hint from %s", entry.worker_id, event.action, event.source)

    async def _flush(
        self, entry: WorkerEntry, daemon: DaemonEndpoint, deadline_unix: float
    ) -> None:
        timeout = max(0.0, deadline_unix - self._clock()) + FLUSH_WAIT_MARGIN_SECONDS
        # Each staged request's KV also goes daemon to daemon, to its target's.
        peer_targets = {
            move.request_id: move.lease.entry.daemon_address
            for move in self._moves.values()
            if move.source_address == entry.address and move.lease.entry.daemon_address
        }
        try:
            async for report in daemon.flush(deadline_unix, timeout, peer_targets):
                self.flushed(entry.address, report)
        except grpc.aio.AioRpcError as exc:
            log.warning("flush through the daemon of %s failed: %s", entry.worker_id, exc)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for request_id in list(self._moves):
            self.abandon(request_id, "the coordinator stops")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for daemon in self._daemons.values():
            await daemon.close()


def _blocks_behind(moving: MovingRequest, move: PreparedMove, source: WorkerEntry) -> int:
    """Full blocks of the request's context now (the client's tokens tell) not staged yet."""
    block_tokens = source.capacity.kv_block_tokens if source.capacity else 0
    if not block_tokens:
        return 0
    context = len(moving.request.prompt_token_ids) + moving.delivered_tokens
    return max(0, context - 1) // block_tokens - move.staged_blocks


def _subscribed(entry: WorkerEntry) -> None:
    log.info("watching the notices of worker %s", entry.worker_id)
    entry.notices_watched = True
