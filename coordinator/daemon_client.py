"""The coordinator's side of one worker's context daemon (`spotinfer.v1.ContextDaemon`).

An edge like `worker_client.py`: proto messages and gRPC errors stop here. The coordinator
subscribes to WatchNotices (notices, then one flush report per paused request) and, for a
drill, calls Flush as a cloud notice would make the daemon do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol

from common.channels import PLAINTEXT, TransportConfig, async_channel
from common.messages import FlushReport, NoticeEvent
from protos.convert import flush_report_from_proto, notice_event_from_proto
from protos.spotinfer.v1 import daemon_pb2, daemon_pb2_grpc

# Beyond the daemon's own wait: the call itself (a connection, one reply).
SETTLE_CALL_MARGIN_SECONDS = 2.0


class DaemonEndpoint(Protocol):
    """The calls the coordinator makes on one context daemon (migration.py holds a daemon
    through this; `DaemonClient` is the gRPC one, unit tests script a fake)."""

    address: str

    async def close(self) -> None: ...

    def watch(
        self, on_subscribed: Callable[[], None] = lambda: None, orchestrates: bool = False
    ) -> AsyncIterator[NoticeEvent]:
        """Every notice and flush report from the subscription on, until it breaks."""
        ...

    def flush(
        self,
        deadline_unix: float,
        timeout_seconds: float,
        peer_targets: Mapping[str, str] | None = None,
    ) -> AsyncIterator[FlushReport]:
        """The daemon's Flush: one report per paused request (``peer_targets``: request id ->
        its target's daemon, where the daemon pushes that request's KV too)."""
        ...

    async def settle(self, timeout_seconds: float) -> bool:
        """The daemon's Settle: True once what its worker handed over is written (or it
        persists nothing for it)."""
        ...


class DaemonClient:
    """One channel to one daemon (a DaemonEndpoint). Calls raise grpc.aio.AioRpcError when it does not answer."""

    def __init__(self, address: str, transport: TransportConfig = PLAINTEXT) -> None:
        self.address = address
        self._channel = async_channel(address, transport=transport)
        self._stub = daemon_pb2_grpc.ContextDaemonStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def watch(
        self, on_subscribed: Callable[[], None] = lambda: None, orchestrates: bool = False
    ) -> AsyncIterator[NoticeEvent]:
        """Every notice and flush report from now on, until the stream breaks.
        ``on_subscribed`` runs once the daemon has registered the subscription (it sends
        its headers then): no notice after that moment is missed. ``orchestrates``: this
        coordinator migrates the requests itself and calls Flush when they are staged (the
        daemon waits for it, up to its hand-off time)."""
        call = self._stub.WatchNotices(
            daemon_pb2.WatchNoticesRequest(orchestrates_migration=orchestrates)
        )
        try:
            await call.initial_metadata()
            on_subscribed()
            async for msg in call:
                yield notice_event_from_proto(msg)
        finally:
            call.cancel()

    async def settle(self, timeout_seconds: float) -> bool:
        reply = await self._stub.Settle(
            daemon_pb2.SettleRequest(timeout_seconds=timeout_seconds),
            timeout=timeout_seconds + SETTLE_CALL_MARGIN_SECONDS,
        )
        return bool(reply.settled)

    async def flush(
        self,
        deadline_unix: float,
        timeout_seconds: float,
        peer_targets: Mapping[str, str] | None = None,
    ) -> AsyncIterator[FlushReport]:
        """The daemon's Flush: it has its worker pause and persist every request; one report
        per request as the worker gives it."""
        call = self._stub.Flush(
            daemon_pb2.FlushRequest(deadline_unix=deadline_unix, peer_targets=peer_targets or {}),
            timeout=timeout_seconds,
        )
        try:
            async for msg in call:
                yield flush_report_from_proto(msg)
        finally:
            call.cancel()
