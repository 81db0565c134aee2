"""The worker registry: who is in the cluster, in which role, in which state, with what room.

Workers come from `--worker` / `--standby` flags and from the RegisterWorker call. A worker
that registers itself holds a lease it renews (`register`); a launcher's registration and
the flags hold none. Each entry keeps the last heartbeat (a Stats answer, see `heartbeat.py`) and the coordinator's own count
of requests it placed there, because a heartbeat is up to one interval old while admission
must not overbook a worker between two of them.

A worker's state is derived in one place, `derive_state`, from what is known about it:

    STOPPED ─ deregistered                    (final)
    LOST ──── silent for lost_after_seconds, or its lease ran out; a worker without a lease
              is back to its derived state once it answers again, one with a lease only once
              it has registered again (a partitioned worker may answer the heartbeat before
              it learns it was cut off: it gets no new request until it renews)
    PREEMPTED / MIGRATING / RECOVERING ─ set by the notice and failover paths
    DRAINING ─ the worker says so, or a drain was asked
    DEGRADED ─ the worker says its store does not answer: it could not persist a new
              request's tokens or KV (nor a migrated one's), so it takes none; what it
              runs goes on, its tokens held in memory until Redis answers again
    READY ─── the worker says it is ready
    STARTING ─ anything else (registered, model still loading)
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from common.messages import PoolLabels, Registration, WorkerCapacity
from common.requests import GenerationRequest, SlaClass
from coordinator.errors import UnknownWorker
from coordinator.fleet_model import FleetModel
from coordinator.worker_client import WorkerEndpoint

log = logging.getLogger(__name__)


class WorkerRole(enum.Enum):
    ACTIVE = "active"
    STANDBY = "standby"  # warm (weights loaded); takes no new request until promoted


class WorkerState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    PREEMPTED = "preempted"  # a termination notice arrived
    MIGRATING = "migrating"  # its requests are moving elsewhere
    RECOVERING = "recovering"  # its requests are being recovered from the store
    LOST = "lost"
    STOPPED = "stopped"
    DEGRADED = "degraded"  # its store does not answer: no new request, no migration target


# States the notice / failover paths set; a heartbeat does not clear them.
ORCHESTRATED_STATES = frozenset(
    {WorkerState.PREEMPTED, WorkerState.MIGRATING, WorkerState.RECOVERING, WorkerState.STOPPED}
)


@dataclass
class WorkerEntry:
    """One registered worker. Mutated only by the registry, the heartbeat and admission."""

    address: str
    role: WorkerRole
    client: WorkerEndpoint
    worker_id: str
    registered_monotonic: float
    capacity: WorkerCapacity | None = None
    last_heartbeat_monotonic: float | None = None
    last_heartbeat_unix: float = 0.0
    drain_requested: bool = False
    orchestrated_state: WorkerState | None = None
    state: WorkerState = WorkerState.STARTING
    in_flight: dict[SlaClass, int] = field(default_factory=lambda: dict.fromkeys(SlaClass, 0))
    reserved_kv_blocks: int = 0
    """KV blocks the requests placed here may grow to (prompt + max_tokens each)."""
    daemon_address: str = ""
    """host:port of its context daemon; empty: none known (no notices heard from it)."""
    notices_watched: bool = False
    """The coordinator is subscribed to the daemon's notices right now."""
    suspect_since_monotonic: float | None = None
    """When a stream from this worker broke; it takes no new request until a heartbeat asked
    after that moment answers (a killed worker is not LOST until lost_after_seconds)."""
    pool: PoolLabels = field(default_factory=PoolLabels)
    model_fingerprint: str = ""
    lease_ttl_seconds: float = 0.0
    """0: no lease (a flag or a launcher registered it)."""
    lease_renewed_monotonic: float = 0.0
    awaiting_registration: bool = False
    """A leased worker that was LOST: it stays LOST until it registers again."""

    def lease_expired(self, now_monotonic: float) -> bool:
        return (
            self.lease_ttl_seconds > 0
            and now_monotonic - self.lease_renewed_monotonic > self.lease_ttl_seconds
        )

    def lease_left_seconds(self, now_monotonic: float) -> float:
        if self.lease_ttl_seconds <= 0:
            return 0.0
        return max(0.0, self.lease_renewed_monotonic + self.lease_ttl_seconds - now_monotonic)

    @property
    def in_flight_total(self) -> int:
        return sum(self.in_flight.values())

    def kv_blocks_for(self, request: GenerationRequest) -> int:
        """Blocks the request needs at its longest; 1 while the block size is not known."""
        block_tokens = self.capacity.kv_block_tokens if self.capacity else 0
        if block_tokens <= 0:
            return 1
        length = len(request.prompt_token_ids) + request.sampling.max_tokens
        return math.ceil(length / block_tokens)

    @property
    def kv_headroom_blocks(self) -> int:
        """Free KV blocks as the worker reported them, less what was placed since: whichever is
        smaller (the report lags a heartbeat; the reservation is a worst case)."""
        if self.capacity is None:
            return 0
        by_reservation = self.capacity.kv_blocks_total - self.reserved_kv_blocks
        return min(self.capacity.kv_blocks_free, by_reservation)


def derive_state(
    entry: WorkerEntry, now_monotonic: float, lost_after_seconds: float
) -> WorkerState:
    """The one function that says what state a worker is in (see the module docstring)."""
    if entry.orchestrated_state == WorkerState.STOPPED:
        return WorkerState.STOPPED
    heard = entry.last_heartbeat_monotonic
    silent_since = heard if heard is not None else entry.registered_monotonic
    if now_monotonic - silent_since > lost_after_seconds:
        return WorkerState.LOST
    if entry.awaiting_registration or entry.lease_expired(now_monotonic):
        return WorkerState.LOST
    if entry.orchestrated_state is not None:
        return entry.orchestrated_state
    capacity = entry.capacity
    if entry.drain_requested or (capacity is not None and capacity.draining):
        return WorkerState.DRAINING
    if capacity is not None and capacity.degraded:
        return WorkerState.DEGRADED
    if capacity is not None and capacity.ready:
        return WorkerState.READY
    return WorkerState.STARTING


StateListener = Callable[[WorkerEntry, WorkerState, WorkerState], None]


class Registry:
    """Every worker by address. Not thread-safe: the coordinator's event loop owns it.

    ``listeners`` are called with (entry, old_state, new_state) on every state change, after
    the change; they must not raise.
    """

    def __init__(
        self,
        lost_after_seconds: float,
        client_factory: Callable[[str], WorkerEndpoint],
        clock: Callable[[], float] = time.monotonic,
        fleet_model: FleetModel | None = None,
        max_lease_ttl_seconds: float = math.inf,
    ) -> None:
        self.fleet_model = fleet_model or FleetModel()
        self._max_lease_ttl_seconds = max_lease_ttl_seconds
        self._lost_after_seconds = lost_after_seconds
        self._client_factory = client_factory
        self._clock = clock
        self._entries: dict[str, WorkerEntry] = {}
        self._listeners: list[StateListener] = []

    def subscribe(self, listener: StateListener) -> None:
        self._listeners.append(listener)

    def add(
        self, address: str, role: WorkerRole, worker_id: str = "", daemon_address: str = ""
    ) -> tuple[WorkerEntry, bool]:
        """Registers a worker; a known address keeps its entry and takes the new role (and
        the daemon address, when one is given). Returns the entry and whether it was
        already registered."""
        entry = self._entries.get(address)
        if entry is not None and entry.state != WorkerState.STOPPED:
            if daemon_address:
                entry.daemon_address = daemon_address
            if entry.role != role:
                log.info("worker %s (%s) is now %s", entry.worker_id, address, role.value)
                entry.role = role
                self._notify(entry, entry.state, entry.state)
            return entry, True
        entry = WorkerEntry(
            address=address,
            role=role,
            client=self._client_factory(address),
            worker_id=worker_id or address,
            registered_monotonic=self._clock(),
            daemon_address=daemon_address,
        )
        self._entries[address] = entry
        log.info("worker %s registered at %s as %s", entry.worker_id, address, role.value)
        return entry, False

    def register(self, registration: Registration) -> tuple[WorkerEntry, bool]:
        """A RegisterWorker call: checks the model (raises ModelMismatch), adds or updates the
        entry, and renews its lease when it asks for one. Returns the entry and whether it
        was already registered."""
        self.fleet_model.admit(registration)
        role = WorkerRole.STANDBY if registration.standby else WorkerRole.ACTIVE
        entry, known = self.add(
            registration.address, role, registration.worker_id, registration.daemon_address
        )
        entry.pool = registration.pool
        if registration.model_fingerprint:
            entry.model_fingerprint = registration.model_fingerprint
        if registration.capacity is not None and entry.capacity is None:
            entry.capacity = registration.capacity
        if registration.lease_ttl_seconds > 0:
            if entry.awaiting_registration:
                log.info("worker %s registered again; it takes requests", entry.worker_id)
            entry.lease_ttl_seconds = min(
                registration.lease_ttl_seconds, self._max_lease_ttl_seconds
            )
            entry.lease_renewed_monotonic = self._clock()
            entry.awaiting_registration = False
        self.refresh()
        return entry, known

    def deregister(self, address: str) -> bool:
        """A clean stop: the worker is STOPPED (final; what still runs there fails over).
        Returns whether it was registered."""
        entry = self._entries.get(address)
        if entry is None or entry.state == WorkerState.STOPPED:
            return False
        log.info("worker %s (%s) deregistered", entry.worker_id, address)
        self.set_orchestrated_state(entry, WorkerState.STOPPED)
        return True

    def __iter__(self) -> Iterator[WorkerEntry]:
        return iter(list(self._entries.values()))

    def find(self, worker_id_or_address: str) -> WorkerEntry:
        for entry in self._entries.values():
            if worker_id_or_address in (entry.worker_id, entry.address):
                return entry
        raise UnknownWorker(worker_id_or_address)

    def now(self) -> float:
        return self._clock()

    def record_heartbeat(
        self, entry: WorkerEntry, capacity: WorkerCapacity, asked_monotonic: float
    ) -> None:
        """A Stats answer to a call made at ``asked_monotonic``."""
        suspect_since = entry.suspect_since_monotonic
        if suspect_since is not None and asked_monotonic >= suspect_since:
            log.info("worker %s answers again; it takes requests", entry.worker_id)
            entry.suspect_since_monotonic = None
        entry.capacity = capacity
        entry.last_heartbeat_monotonic = self._clock()
        entry.last_heartbeat_unix = time.time()
        if capacity.worker_id and entry.worker_id == entry.address:
            entry.worker_id = capacity.worker_id

    def set_orchestrated_state(self, entry: WorkerEntry, state: WorkerState | None) -> None:
        """PREEMPTED / MIGRATING / RECOVERING / STOPPED, or None to let heartbeats decide."""
        assert state is None or state in ORCHESTRATED_STATES
        entry.orchestrated_state = state
        self.refresh()

    def suspect(self, entry: WorkerEntry) -> None:
        """A stream from ``entry`` broke: route nothing new to it until it answers a heartbeat.
        Its other requests are left alone (a single stream may break on a healthy worker)."""
        if entry.suspect_since_monotonic is None:
            log.warning(
                "worker %s: a stream broke; no new requests until it answers", entry.worker_id
            )
        entry.suspect_since_monotonic = self._clock()

    def request_drain(self, entry: WorkerEntry) -> None:
        entry.drain_requested = True
        self.refresh()

    def promote(self, entry: WorkerEntry) -> None:
        if entry.role == WorkerRole.STANDBY:
            log.warning("standby %s (%s) promoted to active", entry.worker_id, entry.address)
            entry.role = WorkerRole.ACTIVE
            self._notify(entry, entry.state, entry.state)

    def refresh(self) -> None:
        """Derives every worker's state again and tells listeners what changed."""
        now = self._clock()
        for entry in list(self._entries.values()):
            new = derive_state(entry, now, self._lost_after_seconds)
            old = entry.state
            if new != old:
                if new == WorkerState.LOST and entry.lease_ttl_seconds > 0:
                    entry.awaiting_registration = True
                entry.state = new
                level = logging.WARNING if new == WorkerState.LOST else logging.INFO
                log.log(level, "worker %s: %s -> %s", entry.worker_id, old.value, new.value)
                self._notify(entry, old, new)

    def _notify(self, entry: WorkerEntry, old: WorkerState, new: WorkerState) -> None:
        for listener in self._listeners:
            listener(entry, old, new)

    def routable(self) -> list[WorkerEntry]:
        """Workers that take new requests: ACTIVE and READY (admission also passes over a
        suspect one for now)."""
        return [
            e
            for e in self._entries.values()
            if e.role == WorkerRole.ACTIVE and e.state == WorkerState.READY
        ]

    def ready_standbys(self) -> list[WorkerEntry]:
        return [
            e
            for e in self._entries.values()
            if e.role == WorkerRole.STANDBY and e.state == WorkerState.READY
        ]

    def max_model_len(self) -> int:
        """The context length every ready worker can serve (0 when none is ready)."""
        return _shortest_context([*self.routable(), *self.ready_standbys()])

    def last_max_model_len(self) -> int:
        """The context length every registered worker last reported, ready or not (a noticed
        or lost one): what the fleet served before a capacity gap (0 when none reported)."""
        return _shortest_context(list(self._entries.values()))

    async def close(self) -> None:
        for entry in self._entries.values():
            await entry.client.close()


def _shortest_context(entries: list[WorkerEntry]) -> int:
    lengths = [
        e.capacity.max_model_len
        for e in entries
        if e.capacity is not None and e.capacity.max_model_len > 0
    ]
    return min(lengths) if lengths else 0
