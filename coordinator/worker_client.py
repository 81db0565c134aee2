"""The coordinator's side of one worker's `spotinfer.v1.Worker` service.

Like `server.py`, this is an edge: proto messages and gRPC errors stop here. A stream that
ends without a finish, or fails for a reason that is not the request's own fault, becomes
`WorkerStreamBroken`, which the relay hands to its failover policy; a refusal caused by the
request itself (INVALID_ARGUMENT) becomes `InvalidRequest` for the client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import grpc

from common.channels import PLAINTEXT, TransportConfig, async_channel
from common.errors import InvalidRequest
from common.messages import PrefetchResult, WorkerCapacity
from common.requests import GenerationRequest, TokenChunk
from coordinator.constants import ABORT_TIMEOUT_SECONDS, STATS_TIMEOUT_SECONDS
from coordinator.errors import NothingPersisted, WorkerStreamBroken
from protos.convert import (
    chunk_from_proto,
    prefetch_result_from_proto,
    request_to_proto,
    worker_stats_from_proto,
)
from protos.spotinfer.v1 import common_pb2, worker_pb2, worker_pb2_grpc


class PrefetchRefused(RuntimeError):
    """The target will not stage the request (no room, no store, draining, not found).
    ``unavailable``: it could not (UNAVAILABLE: its store, or itself, did not answer), not
    that it would not."""

    def __init__(self, message: str, unavailable: bool = False) -> None:
        super().__init__(message)
        self.unavailable = unavailable


class WorkerEndpoint(Protocol):
    """The calls the coordinator makes on one worker (the registry, heartbeat, relay,
    failover and migration hold a worker through this). `WorkerClient` is the gRPC one;
    unit tests script a fake. Streams are lazy: their errors come out while iterating."""

    address: str

    async def close(self) -> None: ...

    async def stats(self) -> WorkerCapacity:
        """Raises grpc.aio.AioRpcError when the worker does not answer in time."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenChunk]:
        """The request's output; a broken stream raises WorkerStreamBroken, a refusal of the
        request itself InvalidRequest."""
        ...

    def resume(
        self,
        request_id: str,
        from_index: int,
        delivered: Sequence[int] = (),
        request: GenerationRequest | None = None,
    ) -> AsyncIterator[TokenChunk]:
        """The rest of a persisted request from ``from_index``, continued from prompt +
        ``delivered`` (the tokens the client has) when given; NothingPersisted when the
        store holds no record of it. ``request``: the request itself, which the worker
        resumes from when its store cannot be reached."""
        ...

    async def abort(self, request_id: str) -> bool:
        """False when the request no longer runs there."""
        ...

    async def prefetch(self, request_id: str, timeout_seconds: float) -> PrefetchResult:
        """One migration stage on this worker as the target; raises PrefetchRefused."""
        ...

    async def drop_prefetch(self, request_id: str) -> int:
        """Frees what the stages staged here; best effort."""
        ...

    async def drain(self, grace_seconds: float) -> int: ...


class WorkerClient:
    """One channel to one worker (a WorkerEndpoint). Not thread-safe: use from the coordinator's event loop."""

    def __init__(
        self, address: str, max_message_bytes: int, transport: TransportConfig = PLAINTEXT
    ) -> None:
        self.address = address
        self._channel = async_channel(address, max_message_bytes, transport)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def stats(self) -> WorkerCapacity:
        """Raises grpc.aio.AioRpcError when the worker does not answer in time."""
        msg = await self._stub.Stats(worker_pb2.StatsRequest(), timeout=STATS_TIMEOUT_SECONDS)
        return worker_stats_from_proto(msg)

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenChunk]:
        return self._follow(self._stub.Generate(request_to_proto(request)))

    def resume(
        self,
        request_id: str,
        from_index: int,
        delivered: Sequence[int] = (),
        request: GenerationRequest | None = None,
    ) -> AsyncIterator[TokenChunk]:
        """Worker.Resume: the rest of a request from its persisted state, from ``from_index``,
        continued from prompt + ``delivered`` (the client's tokens) when given. Raises
        NothingPersisted when the store holds no record of it."""
        msg = worker_pb2.ResumeRequest(
            request_id=request_id, from_index=from_index, delivered_token_ids=delivered
        )
        if request is not None:
            msg.request.CopyFrom(request_to_proto(request))
        return self._follow(self._stub.Resume(msg), resuming=True)

    async def _follow(
        self,
        call: grpc.aio.UnaryStreamCall[object, common_pb2.GenerateResponse],
        resuming: bool = False,
    ) -> AsyncIterator[TokenChunk]:
        try:
            async for msg in call:
                yield chunk_from_proto(msg)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequest(exc.details() or "invalid request") from exc
            if resuming and exc.code() == grpc.StatusCode.NOT_FOUND:
                raise NothingPersisted(f"worker {self.address}: {exc.details()}") from exc
            raise WorkerStreamBroken(
                f"worker {self.address}: {exc.code().name}: {exc.details()}"
            ) from exc
        finally:
            call.cancel()

    async def abort(self, request_id: str) -> bool:
        """Asks the worker to stop the request; False when it no longer runs there."""
        try:
            await self._stub.Abort(
                worker_pb2.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_SECONDS
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise
        return True

    async def prefetch(self, request_id: str, timeout_seconds: float) -> PrefetchResult:
        """One stage of a staged migration on this worker as the target; raises
        PrefetchRefused (any answer but OK: the handshake ends there)."""
        try:
            msg = await self._stub.Prefetch(
                worker_pb2.PrefetchRequest(request_id=request_id), timeout=timeout_seconds
            )
        except grpc.aio.AioRpcError as exc:
            raise PrefetchRefused(
                f"{exc.code().name}: {exc.details()}",
                unavailable=exc.code() == grpc.StatusCode.UNAVAILABLE,
            ) from exc
        return prefetch_result_from_proto(msg)

    async def drop_prefetch(self, request_id: str) -> int:
        """Frees what a stage staged here (an aborted handshake); best effort: 0 on error."""
        try:
            msg = await self._stub.DropPrefetch(
                worker_pb2.DropPrefetchRequest(request_id=request_id),
                timeout=ABORT_TIMEOUT_SECONDS,
            )
        except grpc.aio.AioRpcError:
            return 0
        return int(msg.dropped_blocks)

    async def drain(self, grace_seconds: float) -> int:
        response = await self._stub.Drain(
            worker_pb2.DrainRequest(grace_seconds=grace_seconds), timeout=ABORT_TIMEOUT_SECONDS
        )
        return int(response.in_flight)
