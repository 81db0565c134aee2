"""The worker's gRPC edge: `spotinfer.v1.Worker` over one `Engine`, health and reflection.

Proto messages stop here. Health is NOT_SERVING until the engine has loaded, and again from
the moment a drain or a preempt starts, so the coordinator routes only to a worker that will
answer. Besides TCP the worker may listen on a unix socket (``--unix-socket``): the channel
its context daemon uses on the same host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from common.advertise import AdvertiseError, resolve_advertise_address
from common.authz import (
    COORDINATOR,
    DAEMON,
    OPERATOR,
    OWN_DAEMON,
    AuthorizationInterceptor,
    roles,
)
from common.channels import async_server, listen
from common.messages import Registration, WorkerCapacity
from common.requests import GenerationRequest
from common.rpc import add_health_and_reflection, maps_errors, set_serving, stop_on_signals
from common.validation import check_prompt_choice, check_request_id
from protos.convert import (
    chunk_to_proto,
    flush_report_to_proto,
    prefetch_result_to_proto,
    priority_from_proto,
    sampling_from_proto,
    sla_from_proto,
    worker_stats_to_proto,
)
from protos.spotinfer.v1 import common_pb2, daemon_pb2, worker_pb2, worker_pb2_grpc
from store import RedisStore
from worker.config import WorkerConfig
from worker.constants import SERVER_STOP_GRACE_SECONDS
from worker.engine import Engine, WorkerStatus
from worker.metrics import LiveNumbers, WorkerMetrics
from worker.registration import Registrar

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name

# Who may call what (common.authz): the coordinator routes, an operator inspects and drains;
# pausing, resuming and prefetching KV only the coordinator or the daemon of this worker's own
# node (its certificate names the worker id, or it calls over the unix socket / loopback).
AUTHORIZATION = {
    SERVICE_NAME: {
        "Generate": roles(COORDINATOR, OPERATOR),
        "Abort": roles(COORDINATOR, OPERATOR),
        "Drain": roles(COORDINATOR, OPERATOR),
        "Stats": roles(COORDINATOR, DAEMON, OPERATOR),
        "DropPrefetch": roles(COORDINATOR),
        "Preempt": roles(COORDINATOR, OWN_DAEMON),
        "Resume": roles(COORDINATOR, OWN_DAEMON),
        "Prefetch": roles(COORDINATOR, OWN_DAEMON),
    }
}


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        engine: Engine,
        set_health: Callable[[bool], Awaitable[None]] | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self._engine = engine
        self._set_health = set_health
        self._metrics = metrics or WorkerMetrics()

    def _to_request(self, msg: common_pb2.GenerateRequest) -> GenerationRequest:
        check_request_id(msg.request_id)
        check_prompt_choice(msg.prompt, msg.prompt_token_ids)
        token_ids = (
            tuple(msg.prompt_token_ids)
            if msg.prompt_token_ids
            else self._engine.tokenize(msg.prompt)
        )
        return GenerationRequest(
            request_id=msg.request_id or f"req-{uuid.uuid4().hex}",
            prompt_token_ids=token_ids,
            sampling=sampling_from_proto(msg.sampling),
            sla_class=sla_from_proto(msg.sla_class),
            tenant=msg.tenant,
            priority=priority_from_proto(msg),
        )

    @maps_errors
    async def Generate(  # noqa: N802 - gRPC method name
        self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GenerateResponse]:
        timer = self._metrics.request_timer("generate")
        try:
            generation = self._to_request(request)
            timer.sla_class = generation.sla_class
            async with contextlib.aclosing(self._engine.generate(generation)) as chunks:
                async for chunk in chunks:
                    timer.see(chunk)
                    yield chunk_to_proto(chunk)
        finally:
            timer.finish()

    @maps_errors
    async def Resume(  # noqa: N802
        self, request: worker_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GenerateResponse]:
        timer = self._metrics.request_timer("resume")
        try:
            check_request_id(request.request_id)
            async with contextlib.aclosing(
                self._engine.resume(
                    request.request_id,
                    request.from_index,
                    tuple(request.delivered_token_ids),
                    self._to_request(request.request) if request.HasField("request") else None,
                )
            ) as chunks:
                async for chunk in chunks:
                    timer.see(chunk)
                    yield chunk_to_proto(chunk)
        finally:
            timer.finish()

    @maps_errors
    async def Prefetch(  # noqa: N802
        self, request: worker_pb2.PrefetchRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefetchResponse:
        check_request_id(request.request_id)
        outcome = await self._engine.prefetch(request.request_id)
        return prefetch_result_to_proto(outcome)

    @maps_errors
    async def DropPrefetch(  # noqa: N802
        self, request: worker_pb2.DropPrefetchRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DropPrefetchResponse:
        check_request_id(request.request_id)
        return worker_pb2.DropPrefetchResponse(
            dropped_blocks=self._engine.drop_prefetch(request.request_id)
        )

    @maps_errors
    async def Abort(  # noqa: N802
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        await self._engine.abort(request.request_id)
        return worker_pb2.AbortResponse(aborted=True)

    @maps_errors
    async def Drain(  # noqa: N802
        self, request: worker_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DrainResponse:
        in_flight = self._engine.in_flight
        if self._set_health is not None:
            await self._set_health(False)
        asyncio.get_running_loop().create_task(self._engine.drain(request.grace_seconds))
        return worker_pb2.DrainResponse(in_flight=in_flight)

    @maps_errors
    async def Preempt(  # noqa: N802
        self, request: worker_pb2.PreemptRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[daemon_pb2.FlushProgress]:
        if self._set_health is not None:
            await self._set_health(False)
        self._metrics.preempted(self._engine.in_flight)
        worker_id = self._engine.config.worker_id
        async for state in self._engine.preempt(request.deadline_unix):
            yield flush_report_to_proto(state.report(worker_id))

    @maps_errors
    async def Stats(  # noqa: N802
        self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStats:
        return worker_stats_to_proto(capacity(self._engine.status(), self._engine.config))


def capacity(status: WorkerStatus, config: WorkerConfig) -> WorkerCapacity:
    """The engine's status as the Stats message reports it."""
    shape = status.shape
    total = shape.kv_blocks_total if shape is not None else 0
    used = round(status.engine.kv_cache_usage * total)
    return WorkerCapacity(
        worker_id=status.worker_id,
        ready=status.ready,
        draining=status.draining,
        degraded=status.degraded,
        running_seqs=status.engine.running_seqs,
        waiting_seqs=status.engine.waiting_seqs,
        kv_blocks_total=total,
        kv_blocks_free=total - used,
        kv_block_tokens=shape.kv_block_tokens if shape is not None else 0,
        max_num_seqs=shape.max_num_seqs if shape is not None else 0,
        max_model_len=shape.max_model_len if shape is not None else 0,
        model=config.model,
        tokens_per_second=status.engine.tokens_per_second,
        generated_tokens_total=status.engine.generated_tokens_total,
        requests_total=status.requests_total,
        stopping_deadline_unix=status.stopping_deadline_unix,
        kv_persistence=config.kv_persistence,
    )


async def serve(config: WorkerConfig, stop: asyncio.Event | None = None) -> int:
    """Runs the worker until SIGTERM/SIGINT (or `stop`), then drains. Returns an exit code."""
    stop = stop_on_signals(stop)
    loop = asyncio.get_running_loop()

    store = RedisStore.from_config(config.store) if config.store.url else None
    metrics = WorkerMetrics()
    metrics.describe_persistence(config.kv_persistence)
    engine = Engine(config, store, metrics)
    metrics.read_live_from(lambda: live_numbers(engine))
    if config.metrics_port:
        metrics.serve(config.host, config.metrics_port)
    server = async_server(
        config.max_message_bytes,
        interceptors=[AuthorizationInterceptor(AUTHORIZATION, node=config.worker_id)],
    )
    health = add_health_and_reflection(server, [SERVICE_NAME])

    async def set_health(serving: bool) -> None:
        await set_serving(health, [SERVICE_NAME], serving)

    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerService(engine, set_health, metrics), server)
    await set_serving(health, [SERVICE_NAME], False)
    port = listen(server, f"{config.host}:{config.port}", config.transport)
    if config.unix_socket:
        listen(server, f"unix:{config.unix_socket}", config.transport)
    await server.start()
    # One line a launcher can wait for, also when the port was picked by the OS.
    print(f"spotinfer worker {config.worker_id} listening on {config.host}:{port}", flush=True)

    try:
        advertised = await _advertised_address(config, port)
    except AdvertiseError as exc:
        log.error("%s", exc)
        await server.stop(0)
        return 1
    start = loop.create_task(engine.start())
    stopped = loop.create_task(stop.wait())
    await asyncio.wait({start, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if start.done() and start.exception() is not None:
        log.error("the engine failed to start: %s", start.exception())
        await server.stop(0)
        return 1
    registrar: Registrar | None = None
    renewing: asyncio.Task[None] | None = None
    if start.done():
        await set_serving(health, [SERVICE_NAME], True)
        print(f"spotinfer worker {config.worker_id} ready", flush=True)
        if config.coordinator_addresses:
            registrar = _registrar(config, engine, advertised)
            renewing = loop.create_task(registrar.run())
        await asyncio.wait(
            {stopped, *([renewing] if renewing else [])}, return_when=asyncio.FIRST_COMPLETED
        )
    else:
        start.cancel()

    await set_serving(health, [SERVICE_NAME], False)
    if start.done():
        # Still renewing while its requests move: the lease must outlast them.
        moved, cut = await engine.stop(config.drain_grace_seconds)
        log.info("stopped: %d request(s) moved away, %d cut at the grace limit", moved, cut)
    if registrar is not None and renewing is not None:
        renewing.cancel()
        await asyncio.gather(renewing, return_exceptions=True)
        await registrar.deregister(advertised)
        await registrar.close()
    await server.stop(SERVER_STOP_GRACE_SECONDS)
    await engine.close_persistence(SERVER_STOP_GRACE_SECONDS)
    engine.shutdown()
    metrics.stop()
    if store is not None:
        store.close()
    if registrar is not None and registrar.refusal:
        log.error("stopped: %s", registrar.refusal)
        return 1
    return 0


async def _advertised_address(config: WorkerConfig, port: int) -> str:
    """host:port the coordinator reaches this worker at (see common/advertise.py); looked up
    only for a worker that registers itself."""
    if config.advertise_address:
        return f"{config.advertise_address}:{port}"
    if not config.coordinator_addresses:
        return f"{config.host}:{port}"
    host = await asyncio.to_thread(
        resolve_advertise_address, config.host, config.pool.cloud, config.metadata_url
    )
    return f"{host}:{port}"


def _registrar(config: WorkerConfig, engine: Engine, advertised: str) -> Registrar:
    host = advertised.rpartition(":")[0]
    daemon_address = config.daemon_address
    if daemon_address.startswith(":"):
        daemon_address = f"{host}{daemon_address}"

    def registration() -> Registration:
        return Registration(
            address=advertised,
            standby=config.standby,
            worker_id=config.worker_id,
            daemon_address=daemon_address,
            lease_ttl_seconds=config.lease_ttl_seconds,
            pool=config.pool,
            capacity=capacity(engine.status(), config),
            model_fingerprint=engine.fingerprint,
            model=config.model,
        )

    return Registrar(
        config.coordinator_addresses,
        registration,
        config.lease_interval_seconds,
        transport=config.transport,
    )


def live_numbers(engine: Engine) -> LiveNumbers:
    """The engine's present state for the metrics (called from the scraping thread: only
    reads that EngineStats locks, or plain attributes)."""
    status = engine.status()
    return LiveNumbers(
        running_seqs=status.engine.running_seqs,
        waiting_seqs=status.engine.waiting_seqs,
        kv_blocks_total=status.shape.kv_blocks_total if status.shape is not None else 0,
        kv_cache_usage=status.engine.kv_cache_usage,
        tokens_per_second=status.engine.tokens_per_second,
        generated_tokens_total=status.engine.generated_tokens_total,
    )
