"""The daemon's channel to its worker: gRPC over loopback TCP or a unix socket.

Proto messages stop here: the daemon sees FlushReport dataclasses (`common.messages`). The
worker is on the same host, so the channel is local either way; `benchmarks/local_channel.py`
measures both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from common.channels import PLAINTEXT, TransportConfig, async_channel
from common.messages import FlushReport
from context_daemon.constants import PREEMPT_MARGIN_SECONDS, WORKER_CALL_TIMEOUT_SECONDS
from protos.convert import flush_report_from_proto
from protos.spotinfer.v1 import worker_pb2, worker_pb2_grpc


class WorkerLink:
    """Calls to the local worker. Raises grpc.aio.AioRpcError when the worker does not answer.

    ``address``: ``host:port`` or ``unix:/path`` (gRPC's own syntax for a unix socket).
    """

    def __init__(self, address: str, transport: TransportConfig = PLAINTEXT) -> None:
        self.address = address
        self._channel = async_channel(address, transport=transport)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    async def preempt(self, deadline_unix: float, now_unix: float) -> AsyncIterator[FlushReport]:
        """The worker's Preempt: one report per paused request, until the deadline."""
        timeout = max(0.0, deadline_unix - now_unix) + PREEMPT_MARGIN_SECONDS
        call = self._stub.Preempt(
            worker_pb2.PreemptRequest(deadline_unix=deadline_unix), timeout=timeout
        )
        async for msg in call:
            yield flush_report_from_proto(msg)

    async def reachable(self) -> bool:
        try:
            await self._stub.Stats(worker_pb2.StatsRequest(), timeout=WORKER_CALL_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError:
            return False
        return True

    async def close(self) -> None:
        await self._channel.close()
