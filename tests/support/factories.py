"""Small factories for the coordinator's core, in-process (after vLLM's
tests/v1/core/utils.py): build only what a test needs, with defaults that serve the common
case, and fakes where a process would be (tests/support/fake_worker.py).

    cluster = make_cluster(workers=2)            # registry + admission + failover + dispatcher
    relay = cluster.submit(make_request("r1"))   # admitted and started, as Generate does
    stream = await cluster.worker(0).next_stream()
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.messages import PoolLabels, Registration
from common.requests import Event, GenerationRequest, Sampling, SlaClass, TokenChunk
from coordinator.admission import Admission, AdmissionLimits
from coordinator.adoption import Adoption
from coordinator.dispatcher import Dispatcher
from coordinator.failover import FailoverPolicy
from coordinator.metrics import CoordinatorMetrics
from coordinator.migration import Migrations
from coordinator.prompt_tokenizer import PromptTokenizer
from coordinator.registry import Registry, WorkerEntry, WorkerRole
from coordinator.relay import Relay
from coordinator.request_table import RequestTable
from coordinator.route_records import RouteRecord
from coordinator.routing import RoutingPolicy
from coordinator.standby_pool import StandbyPool
from coordinator.worker_client import WorkerCapacity
from store import MemoryStore, RequestStore
from tests.support.clock import ManualClock
from tests.support.fake_worker import Call, FakeDaemon, FakeWorker

LOST_AFTER_SECONDS = 3.0
LEASE_TTL_SECONDS = 2.0
FINGERPRINT = "f" * 32
RETENTION_SECONDS = 60.0
CLOSE_TIMEOUT_SECONDS = 0.5
COORDINATOR_ADDRESS = "127.0.0.1:50051"  # what route records call the cluster's coordinator
ADOPT_PAUSE_WAIT_SECONDS = 0.2  # the wait for a RUNNING record to pause, kept short
RELEASE_RETRY_SECONDS = (0.05, 4.0)  # a release that found no record: interval, window


def make_request(
    request_id: str = "r0",
    prompt_len: int = 4,
    max_tokens: int = 8,
    sla: SlaClass = SlaClass.INTERACTIVE,
) -> GenerationRequest:
    return GenerationRequest(
        request_id,
        tuple(range(1, prompt_len + 1)),
        Sampling(max_tokens=max_tokens, ignore_eos=True),
        sla,
    )


def make_requests(
    count: int, prefix: str = "r", sla: SlaClass = SlaClass.INTERACTIVE, max_tokens: int = 8
) -> list[GenerationRequest]:
    return [make_request(f"{prefix}{i}", sla=sla, max_tokens=max_tokens) for i in range(count)]


def make_capacity(worker_id: str, **changes: object) -> WorkerCapacity:
    """A ready worker's Stats answer: 4 slots, 16-token blocks, plenty of KV blocks free."""
    capacity = WorkerCapacity(
        worker_id=worker_id,
        ready=True,
        draining=False,
        degraded=False,
        running_seqs=0,
        waiting_seqs=0,
        kv_blocks_total=1000,
        kv_blocks_free=1000,
        kv_block_tokens=16,
        max_num_seqs=4,
        max_model_len=1024,
        model="tiny",
        tokens_per_second=100.0,
    )
    return dataclasses.replace(capacity, **changes)  # type: ignore[arg-type]


@dataclass
class Fakes:
    """The fakes a registry's client factory made, by address, and their shared call log."""

    workers: dict[str, FakeWorker] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)

    def client(self, address: str) -> FakeWorker:
        worker = self.workers.get(address)
        if worker is None:
            worker = self.workers[address] = FakeWorker(address, calls=self.calls)
        return worker


def make_registry(
    clock: ManualClock | None = None,
    fakes: Fakes | None = None,
    lost_after_seconds: float = LOST_AFTER_SECONDS,
) -> tuple[Registry, Fakes, ManualClock]:
    clock = clock or ManualClock()
    fakes = fakes or Fakes()
    return Registry(lost_after_seconds, fakes.client, clock), fakes, clock


def make_worker_entry(
    registry: Registry,
    address: str,
    role: WorkerRole = WorkerRole.ACTIVE,
    ready: bool = True,
    daemon_address: str = "",
    **capacity: object,
) -> WorkerEntry:
    """Registers ``address`` and records one heartbeat (``ready``, ``capacity`` changes) so
    that its state is derived as the heartbeat would."""
    entry, _ = registry.add(address, role, worker_id=address, daemon_address=daemon_address)
    fake = entry.client
    assert isinstance(fake, FakeWorker)
    fake.capacity = make_capacity(address, ready=ready, **capacity)
    registry.record_heartbeat(entry, fake.capacity, registry.now())
    registry.refresh()
    return entry


def make_registration(
    address: str,
    fingerprint: str = FINGERPRINT,
    lease_ttl_seconds: float = LEASE_TTL_SECONDS,
    standby: bool = False,
    model: str = "tiny",
    **pool: object,
) -> Registration:
    """What a worker that registers itself sends: a lease, its fingerprint, its pool."""
    return Registration(
        address=address,
        standby=standby,
        worker_id=address,
        lease_ttl_seconds=lease_ttl_seconds,
        pool=PoolLabels(**pool) if pool else PoolLabels(cloud="aws", zone="us-east-1a", spot=True),  # type: ignore[arg-type]
        capacity=make_capacity(address),
        model_fingerprint=fingerprint,
        model=model,
    )


def make_limits(
    queue_capacity: int = 8,
    max_seqs_per_worker: int = 0,
    interactive_cap: int = 0,
    batch_cap: int = 0,
    retry_after_ms: int = 250,
    batch_queue_capacity: int | None = None,
    capacity_wait_seconds: float = 0.0,
) -> AdmissionLimits:
    return AdmissionLimits(
        queue_capacity={
            SlaClass.INTERACTIVE: queue_capacity,
            SlaClass.BATCH: queue_capacity
            if batch_queue_capacity is None
            else batch_queue_capacity,
        },
        max_seqs_per_worker=max_seqs_per_worker,
        class_cap_per_worker={SlaClass.INTERACTIVE: interactive_cap, SlaClass.BATCH: batch_cap},
        retry_after_ms=retry_after_ms,
        capacity_wait_seconds=capacity_wait_seconds,
    )


def make_admission(
    registry: Registry,
    limits: AdmissionLimits | None = None,
    routing: str = "least-loaded",
    standbys_wanted: int = 0,
) -> Admission:
    pool = StandbyPool(registry, standbys_wanted)
    return Admission(registry, RoutingPolicy.create(routing), pool, limits or make_limits())


@dataclass
class Routes:
    """Route records in a dict (RouteRecords keeps them in Redis): what a coordinator that
    went away had written."""

    records: dict[str, RouteRecord] = field(default_factory=dict)

    async def get(self, request_id: str) -> RouteRecord | None:
        return self.records.get(request_id)


@dataclass
class Cluster:
    """A coordinator's core wired as `coordinator.server.Coordinator` wires it, around fake
    workers and daemons: no gRPC server, no process."""

    registry: Registry
    admission: Admission
    failover: FailoverPolicy
    migrations: Migrations
    dispatcher: Dispatcher
    table: RequestTable
    fakes: Fakes
    daemons: dict[str, FakeDaemon]
    store: MemoryStore
    clock: ManualClock
    routes: Routes = field(default_factory=Routes)

    def worker(self, index: int) -> FakeWorker:
        return list(self.fakes.workers.values())[index]

    def entry(self, index: int) -> WorkerEntry:
        return self.registry.find(self.worker(index).address)

    def submit(self, request: GenerationRequest) -> Relay:
        return self.dispatcher.submit(
            request.request_id, request.prompt_token_ids, request.sampling, request.sla_class
        )

    async def close(self) -> None:
        for relay in self.table:
            if not relay.finished:
                # A cancel that outlasts this is cut: its task is cancelled with it.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(relay.cancel(), CLOSE_TIMEOUT_SECONDS)
        await self.migrations.close()


def make_cluster(
    workers: int = 2,
    standbys: int = 0,
    failover: str = "resume",
    limits: AdmissionLimits | None = None,
    with_daemons: bool = False,
    store: RequestStore | None = None,
    adoption: bool = False,
) -> Cluster:
    """``workers`` ready active workers (w0, w1, ...) and ``standbys`` ready standbys (s0,
    ...); with ``with_daemons`` each has a fake daemon (d-w0, ...) the coordinator watches;
    with ``adoption`` the dispatcher adopts requests from ``routes`` and the store, as one
    restarted at COORDINATOR_ADDRESS does."""
    registry, fakes, clock = make_registry()
    daemons: dict[str, FakeDaemon] = {}

    def daemon_factory(address: str) -> FakeDaemon:
        daemon = daemons.get(address)
        if daemon is None:
            daemon = daemons[address] = FakeDaemon(address, calls=fakes.calls)
        return daemon

    # Notice deadlines are unix times: the migration clock runs on the registry's.
    migrations = Migrations(registry, daemon_factory, clock)
    admission = make_admission(registry, limits, standbys_wanted=standbys)
    memory = store if isinstance(store, MemoryStore) else MemoryStore()
    policy = FailoverPolicy.create(failover, admission, migrations, store or memory)
    table = RequestTable(RETENTION_SECONDS, clock)
    if policy.acts_on_notice:
        migrations.enable_staging(admission, table.on_worker)
    routes = Routes()
    adopter = Adoption(
        routes,
        memory,
        lambda: COORDINATOR_ADDRESS,
        1 << 20,
        pause_wait_seconds=ADOPT_PAUSE_WAIT_SECONDS,
        release_retry_seconds=RELEASE_RETRY_SECONDS,
    )
    dispatcher = Dispatcher(
        "coordinator-test",
        registry,
        admission,
        policy,
        table,
        PromptTokenizer(""),
        CoordinatorMetrics(),
        adoption=adopter if adoption else None,
    )
    dispatcher.address = COORDINATOR_ADDRESS
    names = [(f"w{i}", WorkerRole.ACTIVE) for i in range(workers)]
    names += [(f"s{i}", WorkerRole.STANDBY) for i in range(standbys)]
    for name, role in names:
        entry = make_worker_entry(
            registry, name, role, daemon_address=f"d-{name}" if with_daemons else ""
        )
        if with_daemons:
            migrations.watch(entry)
    return Cluster(
        registry,
        admission,
        policy,
        migrations,
        dispatcher,
        table,
        fakes,
        daemons,
        memory,
        clock,
        routes,
    )


async def read_all(relay: Relay, from_index: int = 0, timeout: float = 5.0) -> list[TokenChunk]:
    """Everything a reader attached at ``from_index`` gets, to the finish."""

    async def collect() -> list[TokenChunk]:
        return [chunk async for chunk in relay.follow(from_index)]

    return await asyncio.wait_for(collect(), timeout)


def tokens_of(chunks: Sequence[TokenChunk], from_index: int = 0) -> list[int]:
    """The output tokens of a reader's chunks, checking that each index comes once, in order."""
    tokens: list[int] = []
    for chunk in chunks:
        assert chunk.index == from_index + len(tokens), (
            f"index {chunk.index} where {from_index + len(tokens)} was expected"
        )
        tokens.extend(chunk.token_ids)
    return tokens


def events_of(chunks: Sequence[TokenChunk]) -> list[Event]:
    return [chunk.event for chunk in chunks if chunk.event is not None]
