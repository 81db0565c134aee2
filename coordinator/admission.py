"""Admission: one bounded queue per SLA class in front of per-worker concurrency caps.

    Generate ─▶ enqueue ─┬─ a worker has a slot ──────────────▶ Lease (placed at once)
                         ├─ its queue has room ─▶ Ticket ─ wait ─▶ Lease (when a slot frees)
                         │                          └─ no worker ready for capacity_wait_seconds
                         │                             ─▶ NoWorkerInTime (RESOURCE_EXHAUSTED)
                         └─ its queue is full ──▶ QueueFull (RESOURCE_EXHAUSTED + retry hint)

A worker's slots: `max_seqs_per_worker`, else the max_num_seqs its engine was sized for by
the memory planner, so a burst waits here instead of overrunning the worker's KV memory;
optionally fewer per SLA class. INTERACTIVE is served before BATCH: a freed slot goes to the
oldest INTERACTIVE request that fits, and a BATCH request only ever takes a slot that no
waiting INTERACTIVE request can use (their class cap is reached on that worker) — a cap
must not leave slots idle while requests wait. Within a class, first come first served.

With the batch controller on (`batch_controller.py`), each class's cap on each worker is the
one the controller set last, not the static one: a cap it shrank leaves slots idle on
purpose, so that the INTERACTIVE class decodes fast enough.

Capacity gaps (no worker routable and no standby to promote: the fleet was noticed at once
and its replacements boot). With `capacity_wait_seconds` 0 a request that arrives then is
refused at once (NoWorkerAvailable, UNAVAILABLE). Otherwise it waits in its class's queue,
like one waiting for a slot, and is placed by the first `pump` that finds a worker (pump runs
after every heartbeat, and a worker's registration is followed by one). A new arrival that
has waited `capacity_wait_seconds` through the gap — counted from its arrival or from the
start of the gap, whichever is later; a routable worker ends the gap — leaves its queue with
NoWorkerInTime (RESOURCE_EXHAUSTED and the base retry hint: its retry waits in the queue
again). The bound is checked at every pump, so it is met within a heartbeat.

Pools (the labels a worker registers: zone, instance type, spot or on demand). An on-demand
worker of a cloud fleet is the fallback (`PoolLabels.fallback`: a cloud label and no
`--spot`, as the fallback group's VMs register): it takes a new request only when no other
worker has room and
none is left to promote; once they have room again new requests go to them, and the
fallback drains as its requests end (its group can then be scaled to 0). A request that
moves off a noticed or lost worker goes, in this order, to a worker outside that worker's
pool (routable with room, else a promoted standby: in a correlated wave the rest of the
pool is likely next), to the fallback, and only then to the rest of the same pool
(`pool_tiers`).

Requests that were already admitted and must move (`requeue`: their worker was noticed) are
never refused: they go to the head of their class's queue even beyond its capacity, keep that
place, and wait as long as it takes. They take places of the queue all the same: a new
arrival is refused with QueueFull once the queue holds `capacity` tickets, moving ones
included, so a fleet-wide notice leaves that much less room for new requests.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from common.messages import PoolLabels
from common.requests import GenerationRequest, SlaClass
from coordinator.errors import NoWorkerAvailable, NoWorkerInTime, QueueFull
from coordinator.registry import Registry, WorkerEntry
from coordinator.routing import RoutingPolicy
from coordinator.standby_pool import StandbyPool

log = logging.getLogger(__name__)

# The order in which queues are served.
SERVICE_ORDER = (SlaClass.INTERACTIVE, SlaClass.BATCH)

Where = Callable[[WorkerEntry], bool]


def _ordinary(entry: WorkerEntry) -> bool:
    return not entry.pool.fallback


def _fallback(entry: WorkerEntry) -> bool:
    return entry.pool.fallback


@dataclass(frozen=True)
class Tier:
    """Workers a moving request may go to (``where``); ``standby_first``: a ready standby of
    the tier is promoted before a routable worker of it is used."""

    where: Where
    standby_first: bool = False


def pool_tiers(away_from: PoolLabels | None) -> list[Tier]:
    """Where a request that leaves a worker of pool ``away_from`` may go, best first: outside
    that pool, then the on-demand fallback, then the rest of the pool — there an idle standby
    before a busy peer: in a wave the peer's notice may be a moment behind (its requests
    would move again), and a standby holds none to lose. An unlabelled worker's fleet is one
    pool."""
    if away_from is None or not away_from.name:
        return [Tier(_ordinary, standby_first=away_from is not None), Tier(_fallback)]
    pool = away_from.name

    def elsewhere(entry: WorkerEntry) -> bool:
        return _ordinary(entry) and entry.pool.name != pool

    def same_pool(entry: WorkerEntry) -> bool:
        return _ordinary(entry) and entry.pool.name == pool

    return [Tier(elsewhere), Tier(_fallback), Tier(same_pool, standby_first=True)]


@dataclass(frozen=True)
class AdmissionLimits:
    queue_capacity: dict[SlaClass, int]
    max_seqs_per_worker: int  # 0: each worker's max_num_seqs
    class_cap_per_worker: dict[SlaClass, int]  # 0: no cap for that class
    retry_after_ms: int
    capacity_wait_seconds: float = 0.0  # 0: refuse at once while no worker is routable


class ClassCaps(Protocol):
    """Per-worker caps per class that move at run time (the batch controller)."""

    def cap(self, entry: WorkerEntry, sla: SlaClass) -> int: ...


class Lease:
    """A slot on one worker, held by one request until `release` (idempotent)."""

    def __init__(
        self,
        entry: WorkerEntry,
        sla_class: SlaClass,
        kv_blocks: int,
        on_release: Callable[[Lease], None],
    ) -> None:
        self.entry = entry
        self.sla_class = sla_class
        self.kv_blocks = kv_blocks
        self._on_release = on_release
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._on_release(self)


@dataclass(eq=False)
class Ticket:
    """A request waiting in its class's queue. ``moving``: admitted before and moving off a
    noticed worker (never refused for want of a worker)."""

    request: GenerationRequest
    future: asyncio.Future[Lease] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    enqueued_monotonic: float = 0.0
    moving: bool = False


class Admission:
    """Not thread-safe: the coordinator's event loop owns it. ``on_change`` runs after every
    change of queue depth or slot use (metrics read it)."""

    def __init__(
        self,
        registry: Registry,
        policy: RoutingPolicy,
        pool: StandbyPool,
        limits: AdmissionLimits,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self._registry = registry
        self._policy = policy
        self._pool = pool
        self._limits = limits
        self._on_change = on_change
        self._queues: dict[SlaClass, collections.deque[Ticket]] = {
            sla: collections.deque() for sla in SlaClass
        }
        self._caps: ClassCaps | None = None
        self._gap_since_monotonic: float | None = None  # since when no worker is routable

    def use_caps(self, caps: ClassCaps) -> None:
        """Class caps from ``caps`` from now on (the batch controller), not the static ones."""
        self._caps = caps

    # -- queries -------------------------------------------------------------------------

    def depth(self, sla_class: SlaClass) -> int:
        return len(self._queues[sla_class])

    def oldest_wait_seconds(self, sla_class: SlaClass) -> float:
        """How long the oldest request still queued in ``sla_class`` has waited (0: none)."""
        waiting = [t for t in self._queues[sla_class] if not t.future.done()]
        if not waiting:
            return 0.0
        return max(0.0, self._registry.now() - waiting[0].enqueued_monotonic)

    def class_cap(self, entry: WorkerEntry, sla: SlaClass) -> int:
        """The most ``sla`` requests that may be in flight on ``entry`` (0: no class cap)."""
        if self._caps is not None:
            return self._caps.cap(entry, sla)
        return self._limits.class_cap_per_worker.get(sla, 0)

    @property
    def waits_for_capacity(self) -> bool:
        """Whether a request that finds no worker waits for one (else it is refused)."""
        return self._limits.capacity_wait_seconds > 0

    def capacity(self, sla_class: SlaClass) -> int:
        return self._limits.queue_capacity[sla_class]

    def running(self, sla_class: SlaClass) -> int:
        return sum(entry.in_flight[sla_class] for entry in self._registry)

    def worker_slots(self, entry: WorkerEntry) -> int:
        if self._limits.max_seqs_per_worker:
            return self._limits.max_seqs_per_worker
        reported = entry.capacity.max_num_seqs if entry.capacity else 0
        return max(1, reported)

    # -- admission -----------------------------------------------------------------------

    def enqueue(self, request: GenerationRequest) -> Ticket:
        """Places the request at once or queues it (while no worker is routable too, when
        capacity waits are on); raises QueueFull, or NoWorkerAvailable when they are off."""
        sla = request.sla_class
        routable = bool(self._registry.routable()) or self._pool.promote_one() is not None
        if not routable and not self.waits_for_capacity:
            raise NoWorkerAvailable("no worker is ready to serve requests")
        now = self._registry.now()
        ticket = Ticket(request, enqueued_monotonic=now)
        # Waiting requests of a class before this one could use no free slot (every release
        # pumps the queues), so a free slot this request fits is one they cannot take.
        if routable and not self._queues[sla]:
            lease = self._place_new(request)
            if lease is not None:
                ticket.future.set_result(lease)
                return ticket
        queue = self._queues[sla]
        if len(queue) >= self.capacity(sla):
            raise QueueFull(sla.name, self.capacity(sla), self._retry_after_ms())
        queue.append(ticket)
        if not routable:
            if self._gap_since_monotonic is None:
                self._gap_since_monotonic = now
            log.info("request %s waits for a worker to become ready", request.request_id)
        self._on_change()
        return ticket

    async def wait(self, ticket: Ticket) -> Lease:
        """The ticket's lease; a caller cancelled while waiting leaves the queue."""
        try:
            return await asyncio.shield(ticket.future)
        except asyncio.CancelledError:
            self.withdraw(ticket)
            raise

    def withdraw(self, ticket: Ticket) -> None:
        """Takes a waiting ticket out of its queue (or gives back a lease it already got)."""
        queue = self._queues[ticket.request.sla_class]
        if ticket in queue:
            queue.remove(ticket)
            self._on_change()
        future = ticket.future
        if not future.done():
            future.cancel()
        elif not future.cancelled() and future.exception() is None:
            future.result().release()

    def suspect(self, entry: WorkerEntry) -> None:
        """A stream of ``entry`` broke: nothing new goes there until it answers again."""
        self._registry.suspect(entry)

    def place_elsewhere(
        self,
        request: GenerationRequest,
        exclude: frozenset[str],
        away_from: PoolLabels | None = None,
    ) -> Lease | None:
        """A slot for a request that was already admitted and lost its worker (of pool
        ``away_from``): any routable worker but ``exclude`` (addresses), caps ignored —
        dropping an accepted request is worse than one sequence over a cap — promoting a
        standby when none is left; by `pool_tiers`."""
        routable = [
            e
            for e in self._registry.routable()
            if e.address not in exclude and e.suspect_since_monotonic is None
        ]
        for tier in pool_tiers(away_from):
            candidates = [e for e in routable if tier.where(e)]
            if tier.standby_first or not candidates:
                promoted = self._pool.promote_one(exclude, tier.where)
                if promoted is not None:
                    candidates = [promoted]
            if candidates:
                return self._lease(request, self._policy.choose(request, candidates))
        return None

    def reserve(
        self,
        request: GenerationRequest,
        exclude: frozenset[str],
        away_from: PoolLabels | None = None,
    ) -> Lease | None:
        """A slot for a request about to move off a worker of pool ``away_from`` (a staged
        migration's target): a routable worker with room, else a promoted standby, tier by
        tier (`pool_tiers`), else None (it then moves the plain way, through `requeue`,
        once paused)."""
        for tier in pool_tiers(away_from):
            lease = None if tier.standby_first else self._place(request, exclude, tier.where)
            if lease is None:
                promoted = self._pool.promote_one(exclude, tier.where)
                lease = self._lease(request, promoted) if promoted is not None else None
            if lease is None and tier.standby_first:
                lease = self._place(request, exclude, tier.where)
            if lease is not None:
                return lease
        return None

    def requeue(
        self,
        request: GenerationRequest,
        exclude: frozenset[str],
        away_from: PoolLabels | None = None,
    ) -> Ticket:
        """A slot for a request that was already admitted and must move (its worker, of pool
        ``away_from``, was noticed): as `reserve` finds one, else the head of its class's
        queue — beyond the queue's capacity, since the request was accepted once and must
        never fail for want of room; it runs as soon as a slot frees."""
        ticket = Ticket(request, enqueued_monotonic=self._registry.now(), moving=True)
        lease = self.reserve(request, exclude, away_from)
        if lease is not None:
            ticket.future.set_result(lease)
            return ticket
        log.warning("request %s waits for a worker with room to move to", request.request_id)
        self._queues[request.sla_class].appendleft(ticket)
        self._on_change()
        return ticket

    def place_on(self, request: GenerationRequest, entry: WorkerEntry) -> Ticket:
        """A slot on ``entry`` for a request that still runs there (adopted from a coordinator
        that went away, see adoption.py): caps ignored, since it holds that slot already."""
        ticket = Ticket(request)
        ticket.future.set_result(self._lease(request, entry))
        return ticket

    def pump(self) -> None:
        """Gives freed slots to waiting tickets, INTERACTIVE first. Called after any release
        and after every heartbeat (a worker may have become ready)."""
        for sla in SERVICE_ORDER:
            queue = self._queues[sla]
            while queue:
                ticket = queue[0]
                if ticket.future.done():  # withdrawn meanwhile
                    queue.popleft()
                    continue
                lease = self._place_new(ticket.request)
                if lease is None and not self._registry.routable():
                    # Every worker is gone but requests wait: a standby that became ready
                    # since is theirs (standbys are only kept back while others serve).
                    promoted = self._pool.promote_one()
                    if promoted is not None:
                        lease = self._lease(ticket.request, promoted)
                if lease is None:
                    break
                queue.popleft()
                ticket.future.set_result(lease)
            # INTERACTIVE requests still waiting fit nowhere now, so the next class gets only
            # slots they cannot use (their class cap is reached).
        self._refuse_past_capacity_wait()
        self._on_change()

    # -- internals -----------------------------------------------------------------------

    def _has_room(self, entry: WorkerEntry, sla: SlaClass) -> bool:
        if entry.in_flight_total >= self.worker_slots(entry):
            return False
        class_cap = self.class_cap(entry, sla)
        return not class_cap or entry.in_flight[sla] < class_cap

    def _place_new(self, request: GenerationRequest) -> Lease | None:
        """A new request's slot: an ordinary worker with room; with none left at all, a
        promoted ordinary standby; only then the on-demand fallback."""
        lease = self._place(request, where=_ordinary)
        if lease is None and not any(_ordinary(e) for e in self._registry.routable()):
            promoted = self._pool.promote_one(where=_ordinary)
            if promoted is not None:
                lease = self._lease(request, promoted)
        if lease is None:
            lease = self._place(request, where=_fallback)
        return lease

    def _place(
        self,
        request: GenerationRequest,
        exclude: frozenset[str] = frozenset(),
        where: Where | None = None,
    ) -> Lease | None:
        candidates = [
            e
            for e in self._registry.routable()
            if e.suspect_since_monotonic is None
            and e.address not in exclude
            and (where is None or where(e))
            and self._has_room(e, request.sla_class)
        ]
        if not candidates:
            return None
        return self._lease(request, self._policy.choose(request, candidates))

    def _lease(self, request: GenerationRequest, entry: WorkerEntry) -> Lease:
        blocks = entry.kv_blocks_for(request)
        entry.in_flight[request.sla_class] += 1
        entry.reserved_kv_blocks += blocks
        self._on_change()
        return Lease(entry, request.sla_class, blocks, self._release)

    def _release(self, lease: Lease) -> None:
        lease.entry.in_flight[lease.sla_class] -= 1
        lease.entry.reserved_kv_blocks -= lease.kv_blocks
        self.pump()

    def _refuse_past_capacity_wait(self) -> None:
        """Tracks the capacity gap, and takes the new arrivals that waited through it for
        `capacity_wait_seconds` out of their queues with NoWorkerInTime (moving ones stay)."""
        if self._registry.routable() or not self.waits_for_capacity:
            self._gap_since_monotonic = None
            return
        now = self._registry.now()
        if self._gap_since_monotonic is None:
            self._gap_since_monotonic = now
        bound = self._limits.capacity_wait_seconds
        for queue in self._queues.values():
            expired = [
                ticket
                for ticket in queue
                if not ticket.moving
                and now - max(ticket.enqueued_monotonic, self._gap_since_monotonic) >= bound
            ]
            for ticket in expired:
                queue.remove(ticket)
                if ticket.future.done():  # withdrawn meanwhile
                    continue
                log.warning(
                    "request %s: no worker became ready within %g s; refused",
                    ticket.request.request_id,
                    bound,
                )
                ticket.future.set_exception(NoWorkerInTime(bound, self._limits.retry_after_ms))

    def _retry_after_ms(self) -> int:
        """The base hint, once more for every full round of slots the backlog would need."""
        waiting = sum(len(q) for q in self._queues.values())
        slots = sum(self.worker_slots(e) for e in self._registry.routable())
        return self._limits.retry_after_ms * (1 + waiting // max(1, slots))
