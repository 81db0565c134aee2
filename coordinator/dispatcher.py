"""The coordinator's core, shared by the gRPC and the HTTP fronts: validate a request at the
edge, admit it, start its relay, let clients attach and cancel; and react to workers that
are lost or noticed by interrupting the relays they serve.

    front (gRPC / HTTP) ─▶ Dispatcher.submit ─▶ validation ─▶ Admission.enqueue ─▶ Relay
                          Dispatcher.attach  ─▶ RequestTable ─▶ Relay.follow
    Registry (worker lost) ─▶ Dispatcher._on_worker_state ─▶ Relay.interrupt
    worker paused a request on a notice ─▶ Relay ─▶ FailoverPolicy (see migration.py)
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from common.requests import FinishReason, GenerationRequest, Sampling, SlaClass, TokenChunk
from common.validation import (
    Limits,
    check_prompt_choice,
    check_prompt_tokens,
    check_request_id,
    check_sampling,
)
from coordinator.admission import Admission
from coordinator.adoption import Adoption, ReplicaUnavailable
from coordinator.constants import RETENTION_SWEEP_INTERVAL_SECONDS
from coordinator.errors import NoWorkerAvailable, QueueFull, UnknownRequest
from coordinator.failover import FailoverPolicy, InterruptionKind
from coordinator.metrics import CoordinatorMetrics
from coordinator.prompt_tokenizer import PromptTokenizer
from coordinator.registry import Registry, WorkerEntry, WorkerState
from coordinator.relay import Relay
from coordinator.request_table import RequestTable
from coordinator.route_records import RouteRecord, RouteRecords, now_unix_ms

log = logging.getLogger(__name__)

# Without a tokenizer the vocabulary is unknown here; the worker checks token ids itself.
_UNKNOWN_VOCAB_SIZE = 2**32


class Dispatcher:
    def __init__(
        self,
        coordinator_id: str,
        registry: Registry,
        admission: Admission,
        failover: FailoverPolicy,
        table: RequestTable,
        tokenizer: PromptTokenizer,
        metrics: CoordinatorMetrics,
        records: RouteRecords | None = None,
        adoption: Adoption | None = None,
    ) -> None:
        self._coordinator_id = coordinator_id
        self._registry = registry
        self._admission = admission
        self._failover = failover
        self._table = table
        self.tokenizer = tokenizer
        self._metrics = metrics
        self._records = records
        self._adoption = adoption
        self._adopting: dict[str, asyncio.Future[Relay]] = {}
        self.address = ""  # this coordinator's gRPC host:port, once bound (route records)
        self._sweeper: asyncio.Task[None] | None = None
        registry.subscribe(self._on_worker_state)

    # -- requests ------------------------------------------------------------------------

    def limits(self) -> Limits:
        max_model_len = self._registry.max_model_len()
        if max_model_len == 0:
            raise NoWorkerAvailable("no worker is ready to serve requests")
        return Limits(
            max_model_len=max_model_len,
            max_tokens_limit=max_model_len,
            vocab_size=self.tokenizer.vocab_size or _UNKNOWN_VOCAB_SIZE,
        )

    def existing(self, request_id: str) -> Relay | None:
        """The request with that id, if this coordinator has it (Generate then attaches)."""
        return self._table.get(request_id) if request_id and request_id in self._table else None

    def prompt_ids(
        self,
        prompt: str,
        prompt_token_ids: Sequence[int],
        messages: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[int, ...]:
        """Token ids of whichever prompt form the client used."""
        if messages is not None:
            return self.tokenizer.encode_chat(messages)
        check_prompt_choice(prompt, prompt_token_ids)
        return tuple(prompt_token_ids) if prompt_token_ids else self.tokenizer.encode(prompt)

    def submit(
        self,
        request_id: str,
        prompt_token_ids: tuple[int, ...],
        sampling: Sampling,
        sla_class: SlaClass,
        tenant: str = "",
    ) -> Relay:
        """Validates, admits and starts a request; raises InvalidRequest, QueueFull or
        NoWorkerAvailable. A request_id that exists returns that request (no second start)."""
        check_request_id(request_id)
        relay = self.existing(request_id)
        if relay is not None:
            return relay
        try:
            limits = self.limits()
            check_prompt_tokens(prompt_token_ids, limits)
            check_sampling(sampling, len(prompt_token_ids), limits)
            request = GenerationRequest(
                request_id or f"req-{uuid.uuid4().hex}",
                prompt_token_ids,
                sampling,
                sla_class,
                tenant,
            )
            ticket = self._admission.enqueue(request)
        except QueueFull:
            self._metrics.rejected.labels("queue_full").inc()
            raise
        except NoWorkerAvailable:
            self._metrics.rejected.labels("no_worker").inc()
            raise
        except ValueError:
            self._metrics.rejected.labels("invalid").inc()
            raise
        relay = Relay(request, ticket, self._admission, self._failover, self, self.tokenizer)
        self._table.add(relay)
        self._metrics.in_flight.inc()
        self._note(relay)
        relay.start()
        return relay

    async def attach(self, request_id: str, from_index: int) -> AsyncIterator[TokenChunk]:
        """The request's chunks from ``from_index`` on. A request this coordinator does not
        hold is looked up in Redis (see adoption.py): proxied to the replica that relays it,
        or adopted from the store when that coordinator is gone. Raises UnknownRequest or
        IndexOutOfRange."""
        if request_id in self._table or self._adoption is None:
            async for chunk in self._table.get(request_id).follow(from_index):
                yield chunk
            return
        route = await self._adoption.route(request_id)
        if self._adoption.relayed_elsewhere(route):
            try:
                async for chunk in self._adoption.proxy(route, from_index):
                    yield chunk
                return
            except ReplicaUnavailable:
                log.warning(
                    "request %s: its coordinator at %s is gone",
                    request_id,
                    route.coordinator_address,
                )
        if self._adoption.finished(route):
            raise UnknownRequest(request_id)
        relay = await self._adopt(route)
        async for chunk in relay.follow(from_index):
            yield chunk

    async def _adopt(self, route: RouteRecord) -> Relay:
        """One relay per adopted request, however many clients attach at once."""
        request_id = route.request_id
        pending = self._adopting.get(request_id)
        if pending is not None:
            return await asyncio.shield(pending)
        if request_id in self._table:
            return self._table.get(request_id)
        assert self._adoption is not None
        future: asyncio.Future[Relay] = asyncio.get_running_loop().create_future()
        self._adopting[request_id] = future
        try:
            request = await self._adoption.request(route)
            ticket = self._admission.requeue(request, frozenset())
            relay = Relay(request, ticket, self._admission, self._failover, self, self.tokenizer)
            self._table.add(relay)
            self._metrics.in_flight.inc()
            log.warning("request %s adopted (started by %s)", request_id, route.coordinator_id)
            relay.start(adopted=True)
            future.set_result(relay)
            return relay
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a lone caller re-raises it below
            raise
        finally:
            del self._adopting[request_id]

    async def cancel(self, request_id: str) -> tuple[bool, int]:
        relay = self._table.get(request_id)
        cancelled = await relay.cancel()
        return cancelled, relay.delivered_tokens

    @property
    def in_flight(self) -> int:
        return self._table.in_flight

    # -- workers -------------------------------------------------------------------------

    def _on_worker_state(self, entry: WorkerEntry, old: WorkerState, new: WorkerState) -> None:
        if new == old:
            return
        # A noticed (PREEMPTED) worker is not interrupted here: it pauses its requests itself
        # and each stream ends with a NOTICE event, which the relay hands to its policy.
        if new not in (WorkerState.LOST, WorkerState.STOPPED):
            return
        kind, detail = InterruptionKind.WORKER_LOST, f"worker {entry.worker_id} is {new.value}"
        for relay in self._table.on_worker(entry.address):
            self._metrics.failovers.labels(kind.value).inc()
            relay.interrupt(kind, detail)

    # -- RelayObserver -------------------------------------------------------------------

    def placed(self, relay: Relay) -> None:
        self._note(relay)

    def delivered(self, relay: Relay, new_tokens: int) -> None:
        self._metrics.tokens_relayed.inc(new_tokens)
        self._note(relay)

    def finished(self, relay: Relay) -> None:
        self._failover.request_finished(relay.request_id)
        self._metrics.in_flight.dec()
        ttft = tpot = None
        if relay.first_token_monotonic is not None:
            ttft = relay.first_token_monotonic - relay.created_monotonic
            if relay.delivered_tokens > 1 and relay.finished_monotonic is not None:
                decode_seconds = relay.finished_monotonic - relay.first_token_monotonic
                tpot = decode_seconds / (relay.delivered_tokens - 1)
        self._metrics.request_done(relay.request.sla_class, relay.finish_reason, ttft, tpot)
        self._note(relay)

    def _note(self, relay: Relay) -> None:
        if self._records is None:
            return
        self._records.note(
            RouteRecord(
                request_id=relay.request_id,
                coordinator_id=self._coordinator_id,
                owner_worker_id=relay.worker_id,
                status=relay.status.value,
                finish_reason=FinishReason(relay.finish_reason).name,
                delivered_length=relay.delivered_tokens,
                sla_class=relay.request.sla_class.name,
                updated_unix_ms=now_unix_ms(),
                coordinator_address=self.address,
            )
        )

    # -- housekeeping --------------------------------------------------------------------

    def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="sweeper")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(RETENTION_SWEEP_INTERVAL_SECONDS)
            self._table.sweep()
