"""Requests this coordinator did not start: a client re-attaches after its coordinator died
or restarted, or attaches through another replica on the same Redis.

    Attach(id, from) ─▶ not in the table ─▶ route record (Redis)
        ├─ relayed by a live replica at another address ─▶ proxy: that replica's Attach
        └─ its coordinator is gone (or was us, before a restart)
              ─▶ the request's own record (the store) ─▶ wait until it is PAUSED
              ─▶ a new Relay whose source is Worker.Resume(id, 0) ─▶ follow(from)

A worker whose caller vanished pauses and persists the request rather than cancel it (see
worker/engine.py), which is what makes the second branch possible: the request waits in the
store, resumable by any coordinator, with nothing recomputed. A request left alone that way
stays until its keys expire in Redis.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from common.channels import PLAINTEXT, TransportConfig, async_channel
from common.requests import GenerationRequest, SlaClass, TokenChunk
from coordinator.constants import (
    ADOPT_PAUSE_WAIT_SECONDS,
    ADOPT_POLL_SECONDS,
    RECORD_FLUSH_INTERVAL_SECONDS,
)
from coordinator.errors import UnknownRequest
from coordinator.route_records import FINISHED_STATUS, RouteRecord, RouteRecords
from protos.convert import chunk_from_proto
from protos.spotinfer.v1 import inference_pb2, inference_pb2_grpc
from store import RequestNotFound as StoreRequestNotFound
from store import RequestRecord, RequestStatus, RequestStore
from store.request_record import sampling_from_record

log = logging.getLogger(__name__)


class ReplicaUnavailable(RuntimeError):
    """The coordinator that relays a request does not answer; it is adopted instead."""


class Adoption:
    """Finds requests other coordinators started. ``own_address`` returns this coordinator's
    gRPC address as written in route records (known once the server is bound)."""

    def __init__(
        self,
        records: RouteRecords,
        store: RequestStore,
        own_address: Callable[[], str],
        max_message_bytes: int,
        transport: TransportConfig = PLAINTEXT,
    ) -> None:
        self._transport = transport
        self._records = records
        self._store = store
        self._own_address = own_address
        self._max_message_bytes = max_message_bytes

    async def route(self, request_id: str) -> RouteRecord:
        """The request's route record; UnknownRequest when there is none."""
        record = await self._records.get(request_id)
        if record is None:
            # Records are written behind: one started elsewhere a moment ago may not be yet.
            await asyncio.sleep(2 * RECORD_FLUSH_INTERVAL_SECONDS)
            record = await self._records.get(request_id)
        if record is None:
            # Its coordinator died before writing the route: the worker's own record (made
            # at admission) is enough to adopt it — the client's Attach proves it was ours.
            stored = await self._read(request_id)
            record = RouteRecord(
                request_id=request_id,
                coordinator_id="",
                owner_worker_id=stored.owner_worker_id,
                status="running",
                finish_reason="NONE",
                delivered_length=0,
                sla_class=SlaClass.INTERACTIVE.name,
                updated_unix_ms=stored.updated_unix_ms,
            )
        return record

    @staticmethod
    def finished(record: RouteRecord) -> bool:
        """Finished: only the coordinator that relayed it still has its output."""
        return record.status == FINISHED_STATUS

    def relayed_elsewhere(self, record: RouteRecord) -> bool:
        return bool(record.coordinator_address) and (
            record.coordinator_address != self._own_address()
        )

    async def proxy(self, record: RouteRecord, from_index: int) -> AsyncIterator[TokenChunk]:
        """The other replica's Attach. Raises ReplicaUnavailable if it does not answer
        before its first message (later, the client's own reconnect covers a failure)."""
        async with async_channel(
            record.coordinator_address, self._max_message_bytes, self._transport
        ) as ch:
            stub = inference_pb2_grpc.InferenceStub(ch)
            call = stub.Attach(
                inference_pb2.AttachRequest(request_id=record.request_id, from_index=from_index)
            )
            started = False
            try:
                async for msg in call:
                    started = True
                    yield chunk_from_proto(msg)
            except grpc.aio.AioRpcError as exc:
                if started or exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                raise ReplicaUnavailable(record.coordinator_address) from exc

    async def request(self, route: RouteRecord) -> GenerationRequest:
        """The request as the store holds it, once its worker has paused it (a worker sees
        its caller vanish within moments); UnknownRequest when the store has no live record."""
        deadline = time.monotonic() + ADOPT_PAUSE_WAIT_SECONDS
        while True:
            record = await self._read(route.request_id)
            if record.status is RequestStatus.PAUSED or time.monotonic() > deadline:
                break
            await asyncio.sleep(ADOPT_POLL_SECONDS)
        if record.status is not RequestStatus.PAUSED:
            log.warning(
                "request %s is still %s in the store; adopting it anyway",
                route.request_id,
                record.status.value,
            )
        sla = SlaClass.BATCH if route.sla_class == SlaClass.BATCH.name else SlaClass.INTERACTIVE
        return GenerationRequest(
            route.request_id,
            record.prompt_token_ids,
            sampling_from_record(record.sampling_params),
            sla,
            tenant=record.tenant,
        )

    async def _read(self, request_id: str) -> RequestRecord:
        try:
            record = await asyncio.to_thread(self._store.get_request, request_id)
        except StoreRequestNotFound:
            log.info("request %s: the store holds no record of it", request_id)
            raise UnknownRequest(request_id) from None
        if record.status.is_terminal:
            log.info("request %s already ended (%s)", request_id, record.status.value)
            raise UnknownRequest(request_id)
        return record

    def close(self) -> None:
        self._store.close()
