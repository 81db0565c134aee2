"""Requests this coordinator did not start: a client re-attaches after its coordinator died
or restarted, or attaches through another replica on the same Redis.

    Attach(id, from) ─▶ not in the table ─▶ route record (Redis)
        ├─ relayed by a live replica at another address ─▶ proxy: that replica's Attach
        └─ its coordinator is gone (or was us, before a restart) ─▶ the request's own record
              ├─ FINISHED (it ended while nobody relayed it) ─▶ a finished Relay holding its
              │     committed tokens ─▶ follow(from): the rest, then the end, exactly once
              └─ live ─▶ wait while it is RUNNING on a worker that may still pause it
                    ─▶ a new Relay whose source is Worker.Resume(id, 0) ─▶ follow(from)

A worker whose caller vanished pauses and persists the request rather than cancel it (see
worker/streams.py), which is what makes the live branch possible: the request waits in the
store, resumable by any coordinator, with nothing recomputed. One that finished first keeps
its record and tokens until a coordinator says its client got the end (`release`, after a
reader read to the end) or the store's undelivered retention passes.

A record still RUNNING after the wait is resumed on its owner when that worker serves: its
Resume pauses the old run itself before it continues (worker/streams.py `take_over`), so the
request never decodes twice. Only when the owner is gone (LOST, STOPPED, or unknown after
the wait) does the request resume elsewhere, from what the store holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from common.channels import PLAINTEXT, TransportConfig, async_channel
from common.requests import FinishReason, GenerationRequest, SlaClass, TokenChunk
from coordinator.constants import (
    ADOPT_PAUSE_WAIT_SECONDS,
    ADOPT_POLL_SECONDS,
    RECORD_FLUSH_INTERVAL_SECONDS,
    RELEASE_RETRY_INTERVAL_SECONDS,
    RELEASE_RETRY_WINDOW_SECONDS,
)
from coordinator.errors import UnknownRequest
from coordinator.registry import WorkerState
from coordinator.route_records import RouteLookup, RouteRecord
from protos.convert import chunk_from_proto
from protos.spotinfer.v1 import inference_pb2, inference_pb2_grpc
from store import RequestNotFound as StoreRequestNotFound
from store import RequestRecord, RequestStatus, RequestStore, StoreError
from store.request_record import sampling_from_record

log = logging.getLogger(__name__)


# A worker in one of these states runs nothing any more: its requests resume elsewhere.
_GONE = (WorkerState.LOST, WorkerState.STOPPED)


class ReplicaUnavailable(RuntimeError):
    """The coordinator that relays a request does not answer; it is adopted instead."""


@dataclass(frozen=True)
class Adopted:
    """A request found in the store: to resume (``on_owner``: on the worker that still runs
    it), or, when ``finished``, to replay: ``output_ids`` is its whole output."""

    request: GenerationRequest
    record: RequestRecord
    on_owner: bool = False
    output_ids: tuple[int, ...] = ()

    @property
    def finished(self) -> bool:
        return self.record.status is RequestStatus.FINISHED

    @property
    def finish_reason(self) -> FinishReason:
        """How it ended, as its worker recorded it (a record without one: LENGTH when its
        output reached max_tokens, else STOP)."""
        name = self.record.finish_reason
        if name in (FinishReason.STOP.name, FinishReason.LENGTH.name):
            return FinishReason[name]
        full = len(self.output_ids) >= self.request.sampling.max_tokens
        return FinishReason.LENGTH if full else FinishReason.STOP


class Adoption:
    """Finds requests other coordinators started. ``own_address`` returns this coordinator's
    gRPC address as written in route records (known once the server is bound);
    ``pause_wait_seconds``: how long a record may stay RUNNING before it is adopted anyway;
    ``release_retry_seconds``: (interval, window) of a release that found no record."""

    def __init__(
        self,
        records: RouteLookup,
        store: RequestStore,
        own_address: Callable[[], str],
        max_message_bytes: int,
        transport: TransportConfig = PLAINTEXT,
        pause_wait_seconds: float = ADOPT_PAUSE_WAIT_SECONDS,
        release_retry_seconds: tuple[float, float] = (
            RELEASE_RETRY_INTERVAL_SECONDS,
            RELEASE_RETRY_WINDOW_SECONDS,
        ),
    ) -> None:
        self._transport = transport
        self._release_retry_seconds = release_retry_seconds
        self._stopping = asyncio.Event()  # releases stop retrying (the coordinator stops)
        self._pause_wait_seconds = pause_wait_seconds
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

    async def request(
        self, route: RouteRecord, owner_state: Callable[[str], WorkerState | None]
    ) -> Adopted:
        """The request as the store holds it, once no worker runs it any more — or, while one
        still does after the wait, where to resume it (``owner_state``: a worker's state in
        this coordinator's registry, None when unknown). UnknownRequest when the store has
        no record, or one that was cancelled or failed."""
        deadline = time.monotonic() + self._pause_wait_seconds
        while True:
            record = await self._read(route.request_id)
            if record.status is not RequestStatus.RUNNING:
                break
            state = owner_state(record.owner_worker_id)
            if state in _GONE or time.monotonic() > deadline:
                break
            await asyncio.sleep(ADOPT_POLL_SECONDS)
        sla = SlaClass.BATCH if route.sla_class == SlaClass.BATCH.name else SlaClass.INTERACTIVE
        request = GenerationRequest(
            route.request_id,
            record.prompt_token_ids,
            sampling_from_record(record.sampling_params),
            sla,
            tenant=record.tenant,
            priority=record.priority,
        )
        if record.status is RequestStatus.FINISHED:
            output = await asyncio.to_thread(self._store.committed_tokens, route.request_id)
            return Adopted(request, record, output_ids=tuple(output))
        on_owner = record.status is RequestStatus.RUNNING and (
            owner_state(record.owner_worker_id) not in (*_GONE, None)
        )
        if record.status is RequestStatus.RUNNING:
            where = "on it" if on_owner else "elsewhere, from the store"
            log.warning(
                "request %s still runs on %s; resuming it %s",
                route.request_id,
                record.owner_worker_id or "no worker",
                where,
            )
        return Adopted(request, record, on_owner=on_owner)

    async def release(self, request_id: str) -> None:
        """A reader got the request's end: its keys need stay no longer than the retention.

        A store that is down, or that restarted empty, has no record to release yet, but the
        request's worker writes it again once it reaches the store (with every token and its
        end); released then or never, it would keep its keys the undelivered retention. So
        a release that found nothing is tried again for a while (``release_retry_seconds``),
        until the coordinator stops (`stop_retrying`).
        """
        interval, window = self._release_retry_seconds
        deadline = time.monotonic() + window
        while True:
            try:
                if await asyncio.to_thread(self._store.release_request, request_id):
                    log.info("request %s released", request_id)
                    return
                reason = "no record"
            except StoreError as exc:
                reason = str(exc)
            if time.monotonic() + interval > deadline or self._stopping.is_set():
                # They expire after the undelivered retention anyway.
                log.info("request %s: nothing to release (%s)", request_id, reason)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), interval)

    def stop_retrying(self) -> None:
        """Releases still waiting for their record give up now (the coordinator stops: one
        that restarts finds the request again, and a reader's end releases it then)."""
        self._stopping.set()

    async def _read(self, request_id: str) -> RequestRecord:
        try:
            record = await asyncio.to_thread(self._store.get_request, request_id)
        except StoreRequestNotFound:
            log.info("request %s: the store holds no record of it", request_id)
            raise UnknownRequest(request_id) from None
        if record.status.is_terminal and record.status is not RequestStatus.FINISHED:
            log.info("request %s already ended (%s)", request_id, record.status.value)
            raise UnknownRequest(request_id)
        return record

    def close(self) -> None:
        self._store.close()
