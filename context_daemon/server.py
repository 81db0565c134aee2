"""The daemon's gRPC edge: `spotinfer.v1.ContextDaemon` (Status, WatchNotices, Flush), health
and reflection. Proto messages stop here.

With ``--kv-handoff-socket`` the daemon also persists what its worker hands over through
shared memory (persister.py); Settle waits until that is written. CommitTokens answers
UNIMPLEMENTED: per-step token commits are the worker's (it batches them itself).

Peer migration: PushBlocks takes KV blocks a source daemon pushes (peer_receiver.py) into the
staging area (peer_staging.py), FetchStaged hands them to this node's worker, DropStaged frees
them; expired ones are swept here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from common.advertise import WILDCARD_HOSTS, AdvertiseError, resolve_advertise_address
from common.authz import (
    COORDINATOR,
    DAEMON,
    OPERATOR,
    OWN_WORKER,
    WORKER,
    AuthorizationInterceptor,
    roles,
)
from common.channels import async_server, listen
from common.messages import FlushReport, NoticeEvent
from common.rpc import add_health_and_reflection, maps_errors, set_serving, stop_on_signals
from context_daemon.block_chunks import Block, BlockChunk, split_block
from context_daemon.block_mirror import BlockMirror
from context_daemon.config import DaemonConfig
from context_daemon.constants import (
    DAEMON_STOP_GRACE_SECONDS,
    PEER_CHUNK_BYTES,
    PUSH_ACCEPTED_METADATA,
    STAGING_SWEEP_SECONDS,
)
from context_daemon.daemon import ContextDaemon, Hooks, Subscribers
from context_daemon.metrics import DaemonMetrics
from context_daemon.notices import Notice
from context_daemon.peer_migration import PeerMigrator, merged
from context_daemon.peer_receiver import PeerReceiver
from context_daemon.peer_staging import PeerStaging
from context_daemon.persister import Persister
from context_daemon.staged_files import FileStaging
from protos.convert import flush_report_to_proto, notice_event_to_proto
from protos.spotinfer.v1 import daemon_pb2, daemon_pb2_grpc
from store import RedisStore
from store.mac_keyring import LOOPBACK_KEYRING, MacKeyring, keyring_for

log = logging.getLogger(__name__)

SERVICE_NAME = daemon_pb2.DESCRIPTOR.services_by_name["ContextDaemon"].full_name

# Who may call what (common.authz): the worker hands over tokens; a peer daemon pushes KV
# blocks for this node's worker, which alone reads them (the coordinator may drop them when
# a migration aborts); the coordinator subscribes to notices and asks for flushes; an
# operator may look and flush too.
AUTHORIZATION = {
    SERVICE_NAME: {
        "CommitTokens": roles(WORKER),
        "PushBlocks": roles(DAEMON),
        "FetchStaged": roles(OWN_WORKER),
        "DropStaged": roles(OWN_WORKER, COORDINATOR),
        "WatchNotices": roles(COORDINATOR, OPERATOR),
        "Flush": roles(COORDINATOR, OPERATOR),
        "Status": roles(COORDINATOR, OPERATOR),
        "Settle": roles(COORDINATOR, OPERATOR),
    }
}
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_SETTLE_SECONDS = 300.0


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
        self,
        daemon: ContextDaemon,
        subscribers: Subscribers,
        store: RedisStore | None,
        persister: Persister | None = None,
        staging: PeerStaging | None = None,
        keyring: MacKeyring = LOOPBACK_KEYRING,
        migrator: PeerMigrator | None = None,
    ) -> None:
        self._daemon = daemon
        self._subscribers = subscribers
        self._store = store
        self._staging = staging or PeerStaging()
        self._receiver = PeerReceiver(self._staging, keyring)
        self._persister = persister
        self._migrator = migrator

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
        staged = self._staging.stats()
        msg.staged_bytes = staged.staged_bytes
        msg.staged_blocks = staged.staged_blocks
        msg.refused_blocks = staged.refused_blocks
        if self._persister is not None:
            msg.persisted_bytes = self._persister.written_bytes
            msg.pending_writes = self._persister.pending_blocks
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

    @maps_errors
    async def PushBlocks(  # noqa: N802
        self,
        request_iterator: AsyncIterator[daemon_pb2.KvBlockChunk],
        context: grpc.aio.ServicerContext,
    ) -> daemon_pb2.PushBlocksResponse:
        # Headers first: the source writes nothing before them (peer_push.py).
        await context.send_initial_metadata((PUSH_ACCEPTED_METADATA,))
        chunks = (chunk_from_proto(msg) async for msg in request_iterator)
        receipt = await self._receiver.receive(chunks)
        return daemon_pb2.PushBlocksResponse(blocks=receipt.blocks, bytes=receipt.bytes)

    @maps_errors
    async def FetchStaged(  # noqa: N802
        self, request: daemon_pb2.FetchStagedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[daemon_pb2.KvBlockChunk]:
        for key, data in self._staging.fetch(request.request_id, list(request.block_keys)):
            for chunk in split_block(Block(request.request_id, key, data), PEER_CHUNK_BYTES):
                yield chunk_to_proto(chunk)

    @maps_errors
    async def DropStaged(  # noqa: N802
        self, request: daemon_pb2.DropStagedRequest, context: grpc.aio.ServicerContext
    ) -> daemon_pb2.DropStagedResponse:
        dropped = self._staging.drop(request.request_id)
        return daemon_pb2.DropStagedResponse(blocks=dropped.blocks, bytes=dropped.bytes)

    @maps_errors
    async def Settle(  # noqa: N802
        self, request: daemon_pb2.SettleRequest, context: grpc.aio.ServicerContext
    ) -> daemon_pb2.SettleResponse:
        if not 0 <= request.timeout_seconds <= MAX_SETTLE_SECONDS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"timeout_seconds must be within [0, {MAX_SETTLE_SECONDS:.0f}], "
                f"got {request.timeout_seconds}",
            )
        persister = self._persister
        if persister is None:
            return daemon_pb2.SettleResponse(handoff=False, settled=True)
        settled = await asyncio.to_thread(persister.settle, request.timeout_seconds)
        return daemon_pb2.SettleResponse(
            handoff=True,
            settled=settled,
            pending_blocks=persister.pending_blocks,
            written_blocks=persister.written_blocks,
        )

    @maps_errors
    async def Flush(  # noqa: N802
        self, request: daemon_pb2.FlushRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[daemon_pb2.FlushProgress]:
        deadline = request.deadline_unix or (
            time.time() + self._daemon.config.effective_grace_seconds
        )
        reports = self._daemon.flush(deadline)
        if request.peer_targets and self._migrator is not None:
            reports = merged(
                reports,
                self._migrator.migrate(
                    dict(request.peer_targets), deadline, self._daemon.config.daemon_id
                ),
            )
        async for report in reports:
            yield flush_report_to_proto(report)


async def serve(config: DaemonConfig, stop: asyncio.Event | None = None) -> int:
    """Runs the daemon until SIGTERM/SIGINT (or ``stop``). Returns an exit code."""
    stop = stop_on_signals(stop)
    loop = asyncio.get_running_loop()

    store = RedisStore.from_config(config.store) if config.store.url else None
    subscribers = Subscribers()
    metrics = DaemonMetrics(
        config.effective_grace_seconds, store.is_available if store is not None else None
    )
    daemon = ContextDaemon.from_config(
        config, Hooks(subscribers, metrics), orchestrated=subscribers.orchestrated
    )
    metrics.read_state_from(daemon.state)
    staging = (
        FileStaging(Path(config.kv_peer_staging_dir), config.staging)
        if config.kv_peer_staging_dir
        else PeerStaging(config.staging)
    )
    keyring = keyring_for(config.store.mac_key_file)
    persister = None
    migrator = None
    if config.kv_handoff_socket:
        assert store is not None, "the config refuses a hand-off socket without a store"
        mirror = BlockMirror(config.peer_mirror_bytes)
        persister = Persister(config.kv_handoff_socket, store, mirror)
        migrator = PeerMigrator(
            mirror, lambda: persister.ranks if persister else 0, keyring, config.transport
        )
    if config.metrics_port:
        metrics.serve(config.host, config.metrics_port)
    server = async_server(MAX_MESSAGE_BYTES, interceptors=[AuthorizationInterceptor(AUTHORIZATION)])
    health = add_health_and_reflection(server, [SERVICE_NAME])
    daemon_pb2_grpc.add_ContextDaemonServicer_to_server(
        ContextDaemonService(
            daemon,
            subscribers,
            store,
            persister,
            staging=staging,
            keyring=keyring,
            migrator=migrator,
        ),
        server,
    )
    port = listen(server, f"{config.host}:{config.port}", config.transport)
    await server.start()
    runner = loop.create_task(daemon.run(stop))
    sweeper = loop.create_task(staging.sweep(stop, STAGING_SWEEP_SECONDS))
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
    await sweeper
    await server.stop(DAEMON_STOP_GRACE_SECONDS)
    await daemon.worker.close()
    if persister is not None:
        await asyncio.to_thread(persister.close)
    metrics.stop()
    if store is not None:
        store.close()
    return 0


def chunk_from_proto(msg: daemon_pb2.KvBlockChunk) -> BlockChunk:
    return BlockChunk(
        msg.request_id, msg.block_key, msg.offset, msg.block_bytes, msg.data, msg.last
    )


def chunk_to_proto(chunk: BlockChunk) -> daemon_pb2.KvBlockChunk:
    return daemon_pb2.KvBlockChunk(
        request_id=chunk.request_id,
        block_key=chunk.key,
        data=bytes(chunk.data),
        last=chunk.last,
        offset=chunk.offset,
        block_bytes=chunk.block_bytes,
    )


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
