"""The daemon's gRPC edge: `spotinfer.v1.ContextDaemon` (Status, WatchNotices, Flush), health
and reflection. Proto messages stop here.

CommitTokens and PushBlocks are not served by this process (the worker commits tokens and
writes KV blocks to Redis itself); they answer UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator

import grpc

from common.advertise import WILDCARD_HOSTS, AdvertiseError, resolve_advertise_address
from common.channels import async_server, listen
from common.messages import FlushReport, NoticeEvent
from common.rpc import add_health_and_reflection, maps_errors, set_serving
from context_daemon.config import DaemonConfig
from context_daemon.constants import DAEMON_STOP_GRACE_SECONDS
from context_daemon.daemon import ContextDaemon, Hooks, Subscribers
from context_daemon.metrics import DaemonMetrics
from context_daemon.notices import Notice
from protos.convert import flush_report_to_proto, notice_event_to_proto
from protos.spotinfer.v1 import daemon_pb2, daemon_pb2_grpc
from store import RedisStore

log = logging.getLogger(__name__)

SERVICE_NAME = daemon_pb2.DESCRIPTOR.services_by_name["ContextDaemon"].full_name
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


def notice_event(notice: Notice, daemon_id: str, flush: FlushReport | None = None) -> NoticeEvent:
    return NoticeEvent(
        source=notice.source,
        action=notice.action.value,
        deadline_unix=notice.deadline_unix or 0.0,
        received_unix=notice.received_unix,
        daemon_id=daemon_id,
        flush=flush,
    )


class ContextDaemonService(daemon_pb2_grpc.ContextDaemonServicer):
    def __init__(
        self, daemon: ContextDaemon, subscribers: Subscribers, store: RedisStore | None
    ) -> None:
        self._daemon = daemon
        self._subscribers = subscribers
        self._store = store

    @maps_errors
    async def Status(  # noqa: N802 - gRPC method name
        self, request: daemon_pb2.DaemonStatusRequest, context: grpc.aio.ServicerContext
    ) -> daemon_pb2.DaemonStatus:
        state = self._daemon.state
        config = self._daemon.config
        store_available = False
        if self._store is not None:
            store_available = await asyncio.to_thread(self._store.is_available)
        msg = daemon_pb2.DaemonStatus(
            store_available=store_available,
            notice_source=config.notice_source,
            worker_address=config.worker_address,
            flushes=state.flushes,
            last_flush=[flush_report_to_proto(r) for r in state.last_flush.values()],
            worker_reachable=await self._daemon.worker.reachable(),
        )
        if state.last_notice is not None:
            msg.notice.CopyFrom(
                notice_event_to_proto(notice_event(state.last_notice, config.daemon_id))
            )
        return msg

    @maps_errors
    async def WatchNotices(  # noqa: N802
        self, request: daemon_pb2.WatchNoticesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[daemon_pb2.NoticeEvent]:
        # Headers go out at once, so a subscriber knows it is registered before any notice.
        await context.send_initial_metadata(())
        async for event in self._subscribers.stream(orchestrates=request.orchestrates_migration):
            yield notice_event_to_proto(
                notice_event(event.notice, self._daemon.config.daemon_id, event.flush)
            )

    async def CommitTokens(  # noqa: N802
        self, request: daemon_pb2.CommitTokensRequest, context: grpc.aio.ServicerContext
    ) -> daemon_pb2.CommitTokensResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the worker commits tokens itself")
        raise AssertionError("abort raises")

    async def PushBlocks(  # noqa: N802
        self,
        request_iterator: AsyncIterator[daemon_pb2.KvBlockChunk],
        context: grpc.aio.ServicerContext,
    ) -> daemon_pb2.PushBlocksResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "peer migration is not served here")
        raise AssertionError("abort raises")

    @maps_errors
    async def Flush(  # noqa: N802
        self, request: daemon_pb2.FlushRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[daemon_pb2.FlushProgress]:
        async for report in self._daemon.flush(request.deadline_unix):
            yield flush_report_to_proto(report)


async def serve(config: DaemonConfig, stop: asyncio.Event | None = None) -> int:
    """Runs the daemon until SIGTERM/SIGINT (or ``stop``). Returns an exit code."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    store = RedisStore.from_config(config.store) if config.store.url else None
    subscribers = Subscribers()
    metrics = DaemonMetrics(
        config.effective_grace_seconds, store.is_available if store is not None else None
    )
    daemon = ContextDaemon.from_config(
        config, Hooks(subscribers, metrics), orchestrated=subscribers.orchestrated
    )
    metrics.read_state_from(daemon.state)
    if config.metrics_port:
        metrics.serve(config.host, config.metrics_port)
    server = async_server(MAX_MESSAGE_BYTES)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    daemon_pb2_grpc.add_ContextDaemonServicer_to_server(
        ContextDaemonService(daemon, subscribers, store), server
    )
    port = listen(server, f"{config.host}:{config.port}")
    await server.start()
    runner = loop.create_task(daemon.run(stop))
    await set_serving(health, [SERVICE_NAME], True)
    # One line a launcher can wait for, also when the port was picked by the OS.
    advertised = await asyncio.to_thread(advertised_host, config)
    print(
        f"spotinfer daemon {config.daemon_id} listening on {config.host}:{port} "
        f"(reached at {advertised}:{port}), "
        f"notices from {config.notice_source}, worker at {config.worker_address}",
        flush=True,
    )
    await stop.wait()
    await set_serving(health, [SERVICE_NAME], False)
    await runner
    await server.stop(DAEMON_STOP_GRACE_SECONDS)
    await daemon.worker.close()
    metrics.stop()
    if store is not None:
        store.close()
    return 0


def advertised_host(config: DaemonConfig) -> str:
    """The host others reach the daemon at (common/advertise.py); the bound host when the
    metadata service does not say (the daemon's address is the worker's to register)."""
    if config.advertise_address:
        return config.advertise_address
    cloud = config.notice_source if config.host in WILDCARD_HOSTS else ""
    try:
        return resolve_advertise_address(config.host, cloud, config.metadata_url)
    except (AdvertiseError, OSError) as exc:
        log.warning("advertised address unknown: %s", exc)
        return config.host
