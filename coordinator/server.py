"""The coordinator's gRPC edge (`Inference`, `Control`, health, reflection) and the process
that runs it with the HTTP front in one event loop.

Proto messages stop here. Health is SERVING only while at least one worker can take a
request (an active worker that is READY, or a ready standby admission would promote).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc

from common.advertise import resolve_advertise_address
from common.authz import (
    ADMIN_ROLE,
    COORDINATOR,
    OPERATOR,
    TENANT_ROLE,
    WORKER,
    AuthorizationInterceptor,
    Gatekeeper,
    current_caller,
    roles,
)
from common.channels import async_server, listen
from common.errors import InvalidRequest
from common.messages import WorkerCapacity
from common.requests import SlaClass
from common.rpc import add_health_and_reflection, maps_errors, set_serving, stop_on_signals
from coordinator.admission import Admission, AdmissionLimits
from coordinator.adoption import Adoption
from coordinator.attentive_clock import AttentiveClock
from coordinator.batch_control_loop import BatchControlLoop
from coordinator.batch_controller import BatchController
from coordinator.batch_jobs import BatchJobs
from coordinator.batch_lines import DispatcherLines
from coordinator.batch_runner import BatchRunner
from coordinator.config import CoordinatorConfig, check_address, split_worker_flag
from coordinator.constants import (
    MAX_GRACE_SECONDS,
    NOTICE_DEFAULT_GRACE_SECONDS,
    NOTICE_SECONDS_BY_CLOUD,
    RECORD_FLUSH_INTERVAL_SECONDS,
)
from coordinator.daemon_client import DaemonClient
from coordinator.dispatcher import Dispatcher
from coordinator.errors import WorkerUnreachable
from coordinator.failover import FailoverPolicy
from coordinator.fleet_model import FleetModel
from coordinator.heartbeat import Heartbeat
from coordinator.http_front import HttpFront
from coordinator.metrics import CoordinatorMetrics
from coordinator.migration import Migrations
from coordinator.persist_policy import PersistPolicyWatch, cluster_persistence
from coordinator.prompt_tokenizer import PromptTokenizer
from coordinator.registry import Registry, WorkerEntry, WorkerRole, WorkerState
from coordinator.request_table import RequestTable
from coordinator.route_records import RouteRecords
from coordinator.routing import RoutingPolicy
from coordinator.standby_pool import StandbyPool
from coordinator.worker_client import WorkerClient
from protos.convert import (
    chunk_to_proto,
    class_cap_to_proto,
    kv_persistence_to_proto,
    pool_to_proto,
    priority_from_proto,
    registration_from_proto,
    sampling_from_proto,
    sla_from_proto,
    sla_to_proto,
    worker_stats_to_proto,
)
from protos.spotinfer.v1 import (
    common_pb2,
    control_pb2,
    control_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
)
from store import RedisBatchStore, RedisStore, StoreUnavailable

log = logging.getLogger(__name__)

INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
CONTROL_SERVICE = control_pb2.DESCRIPTOR.services_by_name["Control"].full_name
SERVICE_NAMES = (INFERENCE_SERVICE, CONTROL_SERVICE)

# Who may call what (common.authz). Users hold tenant or admin keys; another coordinator
# attaches to the requests it adopts with its node certificate; only a worker or an operator
# certificate registers a worker (an address that will receive users' prompts).
_USERS = roles(TENANT_ROLE, ADMIN_ROLE, COORDINATOR)
_ADMINS = roles(ADMIN_ROLE, OPERATOR)
AUTHORIZATION = {
    INFERENCE_SERVICE: {"Generate": _USERS, "Attach": _USERS, "Cancel": _USERS},
    CONTROL_SERVICE: {
        "ListWorkers": _ADMINS,
        "ClusterStatus": _ADMINS,
        "Drain": _ADMINS,
        "InjectNotice": _ADMINS,
        "RegisterWorker": roles(WORKER, OPERATOR),
        "DeregisterWorker": roles(WORKER, OPERATOR),
    },
}

_ROLE_TO_PROTO = {
    WorkerRole.ACTIVE: control_pb2.WORKER_ROLE_ACTIVE,
    WorkerRole.STANDBY: control_pb2.WORKER_ROLE_STANDBY,
}
_STATE_TO_PROTO = {
    WorkerState.STARTING: control_pb2.WORKER_STATE_STARTING,
    WorkerState.READY: control_pb2.WORKER_STATE_READY,
    WorkerState.DRAINING: control_pb2.WORKER_STATE_DRAINING,
    WorkerState.PREEMPTED: control_pb2.WORKER_STATE_PREEMPTED,
    WorkerState.MIGRATING: control_pb2.WORKER_STATE_MIGRATING,
    WorkerState.RECOVERING: control_pb2.WORKER_STATE_RECOVERING,
    WorkerState.LOST: control_pb2.WORKER_STATE_LOST,
    WorkerState.STOPPED: control_pb2.WORKER_STATE_STOPPED,
    WorkerState.DEGRADED: control_pb2.WORKER_STATE_DEGRADED,
}


class InferenceService(inference_pb2_grpc.InferenceServicer):
    def __init__(self, dispatcher: Dispatcher) -> None:
        self._dispatcher = dispatcher

    @maps_errors
    async def Generate(  # noqa: N802 - gRPC method name
        self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GenerateResponse]:
        relay = self._dispatcher.existing(request.request_id)
        if relay is None:
            await self._dispatcher.tokenizer.ready()
            prompt_ids = self._dispatcher.prompt_ids(request.prompt, request.prompt_token_ids)
            relay = self._dispatcher.submit(
                request.request_id,
                prompt_ids,
                sampling_from_proto(request.sampling),
                sla_from_proto(request.sla_class),
                current_caller().tenant,
                priority_from_proto(request),
            )
        async for chunk in relay.follow(0):
            yield chunk_to_proto(chunk)

    @maps_errors
    async def Attach(  # noqa: N802
        self, request: inference_pb2.AttachRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GenerateResponse]:
        async for chunk in self._dispatcher.attach(request.request_id, request.from_index):
            yield chunk_to_proto(chunk)

    @maps_errors
    async def Cancel(  # noqa: N802
        self, request: inference_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.CancelResponse:
        cancelled, generated = await self._dispatcher.cancel(request.request_id)
        return inference_pb2.CancelResponse(cancelled=cancelled, generated_tokens=generated)


def _check_capacity(capacity: WorkerCapacity | None) -> None:
    """A registration's capacity must be one a worker could report: more free KV blocks than
    it has would make every later status answer fail to encode its used blocks."""
    if capacity is not None and capacity.kv_blocks_free > capacity.kv_blocks_total:
        raise ValueError(
            f"capacity: kv_blocks_free ({capacity.kv_blocks_free}) is over kv_blocks_total "
            f"({capacity.kv_blocks_total})"
        )


def _admission_limits(config: CoordinatorConfig) -> AdmissionLimits:
    """The queue capacities and per-worker caps the config sets, per SLA class."""
    return AdmissionLimits(
        queue_capacity={
            SlaClass.INTERACTIVE: config.interactive_queue_capacity,
            SlaClass.BATCH: config.batch_queue_capacity,
        },
        max_seqs_per_worker=config.max_seqs_per_worker,
        class_cap_per_worker={
            SlaClass.INTERACTIVE: config.interactive_max_per_worker,
            SlaClass.BATCH: config.batch_max_per_worker,
        },
        retry_after_ms=config.retry_after_ms,
        capacity_wait_seconds=config.capacity_wait_seconds,
    )


class ControlService(control_pb2_grpc.ControlServicer):
    def __init__(
        self,
        registry: Registry,
        admission: Admission,
        dispatcher: Dispatcher,
        pool: StandbyPool,
        migrations: Migrations,
        failover: FailoverPolicy,
        on_registered: Callable[[WorkerEntry], None],
        batch_jobs: BatchJobs | None = None,
        batch_control: BatchControlLoop | None = None,
    ) -> None:
        self._batch_jobs = batch_jobs
        self._batch_control = batch_control
        self._registry = registry
        self._admission = admission
        self._dispatcher = dispatcher
        self._pool = pool
        self._migrations = migrations
        self._failover = failover
        self._on_registered = on_registered

    def _worker_info(self, entry: WorkerEntry) -> control_pb2.WorkerInfo:
        info = control_pb2.WorkerInfo(
            worker_id=entry.worker_id,
            address=entry.address,
            role=_ROLE_TO_PROTO[entry.role],
            state=_STATE_TO_PROTO[entry.state],
            last_heartbeat_unix=entry.last_heartbeat_unix,
            daemon_address=entry.daemon_address,
            notices_watched=entry.notices_watched,
            pool=pool_to_proto(entry.pool),
            model_fingerprint=entry.model_fingerprint,
            lease_expires_in_seconds=entry.lease_left_seconds(self._registry.now()),
        )
        if entry.capacity is not None:
            info.stats.CopyFrom(worker_stats_to_proto(entry.capacity))
        if self._batch_control is not None:
            info.admission_caps.extend(
                class_cap_to_proto(view) for view in self._batch_control.views(entry)
            )
        return info

    @maps_errors
    async def ListWorkers(  # noqa: N802
        self, request: control_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.ListWorkersResponse:
        return control_pb2.ListWorkersResponse(
            workers=[self._worker_info(e) for e in self._registry]
        )

    @maps_errors
    async def RegisterWorker(  # noqa: N802
        self, request: control_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.RegisterWorkerResponse:
        try:
            check_address(request.address)
            if request.daemon_address:
                check_address(request.daemon_address)
            registration = registration_from_proto(request)
            _check_capacity(registration.capacity)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        entry, known = self._registry.register(registration)
        # Without --model, the tokenizer of the first registered model (text prompts wait).
        self._dispatcher.tokenizer.start_loading(self._registry.fleet_model.model)
        self._migrations.watch(entry)
        if not known:
            self._on_registered(entry)
        return control_pb2.RegisterWorkerResponse(
            worker_id=entry.worker_id,
            already_registered=known,
            fleet_fingerprint=self._registry.fleet_model.fingerprint,
        )

    @maps_errors
    async def DeregisterWorker(  # noqa: N802
        self, request: control_pb2.DeregisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.DeregisterWorkerResponse:
        return control_pb2.DeregisterWorkerResponse(
            was_registered=self._registry.deregister(request.address)
        )

    @maps_errors
    async def Drain(  # noqa: N802
        self, request: control_pb2.DrainWorkerRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.DrainWorkerResponse:
        """Takes the worker out of routing. When the failover policy moves requests on a
        notice and the worker has a context daemon, its requests move exactly as on one
        (staged, flushed, resumed elsewhere, by now + grace); otherwise the worker lets them
        run for the grace and cuts the rest."""
        grace_seconds = _grace_seconds(request.grace_seconds)
        entry = self._registry.find(request.worker_id)
        self._registry.request_drain(entry)
        if self._failover.acts_on_notice and entry.daemon_address:
            moving = self._migrations.moving_requests(entry)
            self._migrations.inject(
                entry, grace_seconds or NOTICE_DEFAULT_GRACE_SECONDS, flush=True
            )
            return control_pb2.DrainWorkerResponse(in_flight=moving)
        try:
            in_flight = await entry.client.drain(grace_seconds)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            raise WorkerUnreachable(entry.worker_id, exc.details() or exc.code().name) from exc
        return control_pb2.DrainWorkerResponse(in_flight=in_flight)

    @maps_errors
    async def InjectNotice(  # noqa: N802
        self, request: control_pb2.InjectNoticeRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.InjectNoticeResponse:
        """For drills: the notice a cloud would give. The worker leaves routing at once; its
        daemon (when registered, and when the failover policy moves paused requests) flushes
        it by the deadline, and its requests migrate (see migration.py)."""
        given_grace = _grace_seconds(request.grace_seconds)
        entry = self._registry.find(request.worker_id)
        grace = given_grace or NOTICE_SECONDS_BY_CLOUD.get(
            request.cloud, NOTICE_DEFAULT_GRACE_SECONDS
        )
        if request.kind == control_pb2.NOTICE_KIND_REBALANCE and not (
            self._migrations.migrate_on_rebalance
        ):
            log.info("rebalance hint for %s: nothing moves yet", entry.worker_id)
            deadline_unix = time.time() + grace
        else:
            deadline_unix = self._migrations.inject(
                entry, grace, flush=self._failover.acts_on_notice
            )
        return control_pb2.InjectNoticeResponse(deadline_unix=deadline_unix)

    @maps_errors
    async def ClusterStatus(  # noqa: N802
        self, request: control_pb2.ClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.ClusterStatusResponse:
        queues = [
            control_pb2.QueueStatus(
                sla_class=sla_to_proto(sla),
                depth=self._admission.depth(sla),
                capacity=self._admission.capacity(sla),
                running=self._admission.running(sla),
            )
            for sla in SlaClass
        ]
        persistence = cluster_persistence(self._registry)
        return control_pb2.ClusterStatusResponse(
            workers=[self._worker_info(e) for e in self._registry],
            queues=queues,
            in_flight=self._dispatcher.in_flight,
            standbys_ready=self._pool.ready,
            batch_jobs=await self._batch_job_statuses(),
            kv_persistence=kv_persistence_to_proto(persistence.agreed),
            kv_persistence_warning=persistence.warning,
        )

    async def _batch_job_statuses(self) -> list[control_pb2.BatchJobStatus]:
        if self._batch_jobs is None:
            return []
        try:
            jobs = await self._batch_jobs.unfinished()
        except StoreUnavailable as exc:  # the rest of the status still answers
            log.warning("batch jobs left out of the status: %s", exc)
            return []
        return [
            control_pb2.BatchJobStatus(
                batch_id=job["id"],
                status=job["status"],
                endpoint=job.get("endpoint", ""),
                total=int(job.get("total", "0")),
                completed=int(job.get("completed", "0")),
                failed=int(job.get("failed", "0")),
                tenant=job.get("tenant", ""),
            )
            for job in jobs
        ]


class Coordinator:
    """Every part of one coordinator, wired together (dependencies through constructors)."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.metrics = CoordinatorMetrics()
        self.clock = AttentiveClock()  # a stall of ours is not the workers' silence
        self.registry = Registry(
            config.lost_after_seconds,
            lambda address: WorkerClient(address, config.max_message_bytes, config.transport),
            clock=self.clock,
            fleet_model=FleetModel(config.model_fingerprint, config.model),
            max_lease_ttl_seconds=config.max_lease_ttl_seconds,
        )
        self.pool = StandbyPool(self.registry, config.standby_pool_size)
        self.admission = Admission(
            self.registry,
            RoutingPolicy.create(config.routing_policy),
            self.pool,
            _admission_limits(config),
            on_change=self._update_queue_metrics,
        )
        self.records = (
            RouteRecords.from_url(
                config.store.url,
                config.record_ttl_seconds,
                config.record_retention_seconds,
                RECORD_FLUSH_INTERVAL_SECONDS,
                config.store,
            )
            if config.store.url
            else None
        )
        self.adoption = (
            Adoption(
                self.records,
                RedisStore.from_config(config.store),
                lambda: self.dispatcher.address,
                config.max_message_bytes,
                config.transport,
            )
            if self.records is not None
            else None
        )
        self.migrations = Migrations(
            self.registry,
            lambda address: DaemonClient(address, config.transport),
            migrate_on_rebalance=config.rebalance_policy == "migrate",
        )
        self.failover = FailoverPolicy.create(
            config.failover_policy,
            self.admission,
            self.migrations,
            RedisStore.from_config(config.store) if config.store.url else None,
        )
        table = RequestTable(config.retention_seconds)
        if self.failover.acts_on_notice:
            self.migrations.enable_staging(self.admission, table.on_worker)
        self.dispatcher = Dispatcher(
            config.coordinator_id,
            self.registry,
            self.admission,
            self.failover,
            table,
            PromptTokenizer(config.model),
            self.metrics,
            self.records,
            self.adoption,
            disconnect_grace_seconds=config.disconnect_grace_seconds,
        )
        self.persist_policies = PersistPolicyWatch()
        self.heartbeat = Heartbeat(
            self.registry, config.heartbeat_interval_seconds, after_beat=self._after_beat
        )
        self.batch_control = self._batch_control_loop()
        self.gatekeeper = Gatekeeper.from_config(config.api_keys)
        self.batch_runner, self.batch_jobs = self._batch_api()
        self.http = self._http_front()
        self._add_flag_workers()
        for sla in SlaClass:
            self.metrics.queue_capacity.labels(sla.name).set(self.admission.capacity(sla))

    def _batch_control_loop(self) -> BatchControlLoop:
        """The batch controller when it is on (it then sets admission's class caps and hears
        every relay's tokens), else a loop that only tells the static caps."""
        settings = self.config.batch_controller
        controller = None
        if settings.enabled:
            static = {
                SlaClass.INTERACTIVE: self.config.interactive_max_per_worker,
                SlaClass.BATCH: self.config.batch_max_per_worker,
            }
            controller = BatchController(
                settings, static, self.registry.now, on_grow=self.admission.pump
            )
            self.admission.use_caps(controller)
            self.dispatcher.batch_controller = controller
        return BatchControlLoop(
            controller, settings.interval_seconds, self.registry, self.admission, self.metrics
        )

    def _http_front(self) -> HttpFront:
        config = self.config
        return HttpFront(
            self.dispatcher,
            self.metrics,
            config.model_name,
            self.gatekeeper,
            config.transport,
            self.batch_jobs,
        )

    def _batch_api(self) -> tuple[BatchRunner | None, BatchJobs | None]:
        """The Batch API's runner and jobs: only with a store, where jobs outlive us."""
        config = self.config
        if not config.store.url:
            return None, None
        store = RedisBatchStore.from_config(config.store)
        lines = DispatcherLines(self.dispatcher, config.model_name)
        runner = BatchRunner(store, lines, config.coordinator_id, config.batch_lines_in_flight)
        return runner, BatchJobs(store, runner)

    def _add_flag_workers(self) -> None:
        for value in self.config.workers:
            self.registry.add(*_worker_and_daemon(value, WorkerRole.ACTIVE))
        for value in self.config.standbys:
            self.registry.add(*_worker_and_daemon(value, WorkerRole.STANDBY))

    def _update_queue_metrics(self) -> None:
        for sla in SlaClass:
            self.metrics.queue_depth.labels(sla.name).set(self.admission.depth(sla))

    def _after_beat(self) -> None:
        self.admission.pump()
        self.pool.check()
        self.metrics.workers.clear()
        for entry in self.registry:
            self.metrics.workers.labels(entry.role.value, entry.state.value).inc()
        self.metrics.standbys_ready.set(self.pool.ready)
        self.metrics.persistence(self.persist_policies.check(self.registry))

    def serving(self) -> bool:
        return bool(self.registry.routable() or self.registry.ready_standbys())

    def start(self) -> None:
        """Background work that needs the running loop: heartbeats, sweeps, subscriptions."""
        self.clock.start()
        self.heartbeat.start()
        self.dispatcher.start()
        self.batch_control.start()
        if self.records is not None:
            self.records.start()
        if self.batch_runner is not None:
            self.batch_runner.start()
        for entry in self.registry:
            self.migrations.watch(entry)

    async def stop(self, server: grpc.aio.Server) -> None:
        """In order: background work, the fronts (open calls get the stop grace), then the
        relays (each worker pauses its request, resumable by the next coordinator)."""
        await self.heartbeat.stop()
        await self.clock.stop()
        await self.batch_control.stop()
        await self.http.stop()
        if self.batch_runner is not None:
            await self.batch_runner.stop()
        await server.stop(self.config.stop_grace_seconds)
        await self.dispatcher.stop()
        await self.migrations.close()
        if self.adoption is not None:
            self.adoption.close()
        if self.records is not None:
            await self.records.stop()
        await self.registry.close()

    async def registered(self, entry: WorkerEntry) -> None:
        """A new worker: ask its Stats now rather than at the next beat."""
        await self.heartbeat.beat()


def _grace_seconds(value: float) -> float:
    """A Drain's or a notice's grace as the operator gave it; raises InvalidRequest unless it
    is a finite number of seconds in [0, MAX_GRACE_SECONDS]."""
    if not math.isfinite(value) or not 0 <= value <= MAX_GRACE_SECONDS:
        raise InvalidRequest(f"grace_seconds must be in [0, {MAX_GRACE_SECONDS:g}], got {value}")
    return value


def _worker_and_daemon(value: str, role: WorkerRole) -> tuple[str, WorkerRole, str, str]:
    """Registry.add's arguments for a --worker / --standby value (``ADDR[=DAEMON]``)."""
    address, daemon_address = split_worker_flag(value)
    return address, role, "", daemon_address


def _bind(server: grpc.aio.Server, config: CoordinatorConfig) -> tuple[int, int]:
    """The public port and, with TLS, the mutual-TLS internal port (0 without TLS)."""
    port = listen(server, f"{config.host}:{config.port}", config.transport, client_auth=False)
    if not config.transport.tls:
        return port, 0
    internal = listen(
        server, f"{config.host}:{config.internal_port}", config.transport, client_auth=True
    )
    return port, internal


async def serve(config: CoordinatorConfig, stop: asyncio.Event | None = None) -> int:
    """Runs the coordinator until SIGTERM/SIGINT (or `stop`). Returns an exit code."""
    stop = stop_on_signals(stop)
    loop = asyncio.get_running_loop()

    coordinator = Coordinator(config)
    await asyncio.to_thread(coordinator.dispatcher.tokenizer.load)
    server = async_server(
        config.max_message_bytes,
        interceptors=[AuthorizationInterceptor(AUTHORIZATION, coordinator.gatekeeper)],
    )
    health = add_health_and_reflection(server, SERVICE_NAMES)
    serving_now: list[bool] = []

    async def update_health() -> None:
        serving = coordinator.serving()
        if serving_now != [serving]:
            serving_now[:] = [serving]
            await set_serving(health, SERVICE_NAMES, serving)

    background: set[asyncio.Task[None]] = set()

    def spawn(coro: Coroutine[Any, Any, None]) -> None:
        task = loop.create_task(coro)
        background.add(task)
        task.add_done_callback(background.discard)

    coordinator.registry.subscribe(lambda *_: spawn(update_health()))
    inference_pb2_grpc.add_InferenceServicer_to_server(
        InferenceService(coordinator.dispatcher), server
    )
    control_pb2_grpc.add_ControlServicer_to_server(
        ControlService(
            coordinator.registry,
            coordinator.admission,
            coordinator.dispatcher,
            coordinator.pool,
            coordinator.migrations,
            coordinator.failover,
            on_registered=lambda entry: spawn(coordinator.registered(entry)),
            batch_jobs=coordinator.batch_jobs,
            batch_control=coordinator.batch_control,
        ),
        server,
    )
    await set_serving(health, SERVICE_NAMES, False)
    port, internal_port = _bind(server, config)
    advertised = config.advertise_address or resolve_advertise_address(config.host, config.cloud)
    # Other coordinators attach to this one's requests where nodes are let in.
    coordinator.dispatcher.address = f"{advertised}:{internal_port or port}"
    await server.start()
    http_port = (
        await coordinator.http.start(config.host, config.http_port) if config.serve_http else 0
    )
    coordinator.start()
    # One line a launcher can wait for, also when the ports were picked by the OS.
    print(
        f"spotinfer coordinator {config.coordinator_id} listening on {config.host}:{port}"
        + (f" (http {config.host}:{http_port})" if config.serve_http else "")
        + (f" (internal {config.host}:{internal_port})" if internal_port else ""),
        flush=True,
    )
    await stop.wait()

    coordinator.dispatcher.begin_stop()  # the clients the stop cuts off did not hang up
    await set_serving(health, SERVICE_NAMES, False)
    await coordinator.stop(server)
    return 0
