"""The daemon's channel to its worker: gRPC over loopback TCP or a unix socket.

Proto messages stop here: the daemon sees FlushReport dataclasses. The worker is on the same
host, so the channel is local either way; `spotinfer/bench/local_channel.py` measures both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from common.channels import async_channel
from context_daemon.constants import PREEMPT_MARGIN_SECONDS, WORKER_CALL_TIMEOUT_SECONDS
from protos.spotinfer.v1 import daemon_pb2, worker_pb2, worker_pb2_grpc


@dataclass(frozen=True)
class FlushReport:
    """How far one paused request's state reached the store (see worker/flush_state.py)."""

    request_id: str
    complete: bool
    committed_tokens: int
    persisted_blocks: int
    tail_persisted: bool
    context_tokens: int
    worker_id: str


def report_from_proto(msg: daemon_pb2.FlushProgress) -> FlushReport:
    return FlushReport(
        request_id=msg.request_id,
        complete=msg.complete,
        committed_tokens=msg.committed_tokens,
        persisted_blocks=msg.persisted_blocks,
        tail_persisted=msg.tail_persisted,
        context_tokens=msg.context_tokens,
        worker_id=msg.worker_id,
    )


def report_to_proto(report: FlushReport) -> daemon_pb2.FlushProgress:
    return daemon_pb2.FlushProgress(
        request_id=report.request_id,
        complete=report.complete,
        committed_tokens=report.committed_tokens,
        persisted_blocks=report.persisted_blocks,
        tail_persisted=report.tail_persisted,
        context_tokens=report.context_tokens,
        worker_id=report.worker_id,
    )


class WorkerLink:
    """Calls to the local worker. Raises grpc.aio.AioRpcError when the worker does not answer.

    ``address``: ``host:port`` or ``unix:/path`` (gRPC's own syntax for a unix socket).
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = async_channel(address)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    async def preempt(self, deadline_unix: float, now_unix: float) -> AsyncIterator[FlushReport]:
        """The worker's Preempt: one report per paused request, until the deadline."""
        timeout = max(0.0, deadline_unix - now_unix) + PREEMPT_MARGIN_SECONDS
        call = self._stub.Preempt(
            worker_pb2.PreemptRequest(deadline_unix=deadline_unix), timeout=timeout
        )
        async for msg in call:
            yield report_from_proto(msg)

    async def reachable(self) -> bool:
        try:
            await self._stub.Stats(worker_pb2.StatsRequest(), timeout=WORKER_CALL_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError:
            return False
        return True

    async def close(self) -> None:
        await self._channel.close()
