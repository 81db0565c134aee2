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
import math
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from common.errors import InvalidRequest
from common.requests import FinishReason, GenerationRequest, Sampling, SlaClass, TokenChunk
from common.validation import (
    Limits,
    check_priority,
    check_prompt_choice,
    check_prompt_tokens,
    check_request_id,
    check_sampling,
)
from coordinator.admission import Admission, Ticket
from coordinator.adoption import Adopted, Adoption, ReplicaUnavailable
from coordinator.batch_controller import BatchController
from coordinator.constants import RETENTION_SWEEP_INTERVAL_SECONDS
from coordinator.errors import NoWorkerAvailable, NoWorkerInTime, QueueFull, UnknownWorker
from coordinator.failover import FailoverPolicy, InterruptionKind
from coordinator.metrics import CoordinatorMetrics
from coordinator.prompt_tokenizer import PromptTokenizer
from coordinator.registry import Registry, WorkerEntry, WorkerState
from coordinator.relay import Relay
from coordinator.request_table import RequestTable
from coordinator.route_records import RouteRecord, RouteRecords, now_unix_ms

log = logging.getLogger(__name__)

# Ends whose record the store keeps until a reader got them (store: undelivered retention).
_HELD_FINISHES = (FinishReason.STOP, FinishReason.LENGTH)
# Without a tokenizer the vocabulary is unknown here; the worker checks token ids itself.
_UNKNOWN_VOCAB_SIZE = 2**32
# Before any worker reported its context length; the worker checks against its own.
_UNKNOWN_CONTEXT_LENGTH = 2**31


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
        disconnect_grace_seconds: float = math.inf,
    ) -> None:
        """``disconnect_grace_seconds``: how long a running request whose every client left
        waits for one to attach again before it is cancelled (inf: it runs to its end). BATCH
        requests always run to their end: nobody waits on their stream."""
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
        self._releases: set[asyncio.Task[None]] = set()
        self._disconnect_grace_seconds = disconnect_grace_seconds
        self._orphans: set[asyncio.Task[None]] = set()
        self._stopping = False
        self.batch_controller: BatchController | None = None
        """Told every request's first token and later tokens, when it is on."""
        registry.subscribe(self._on_worker_state)

    # -- requests ------------------------------------------------------------------------

    def limits(self) -> Limits:
        """What the ready workers can take; while none is ready (and requests wait for one),
        what the workers last reported. Raises NoWorkerAvailable when nothing is known."""
        max_model_len = self._registry.max_model_len()
        if max_model_len == 0 and self._admission.waits_for_capacity:
            max_model_len = self._registry.last_max_model_len()
        if max_model_len == 0:
            raise NoWorkerAvailable("no worker is ready to serve requests")
        return Limits(
            max_model_len=max_model_len,
            max_tokens_limit=max_model_len,
            vocab_size=self.tokenizer.vocab_size or _UNKNOWN_VOCAB_SIZE,
        )

    def _submit_limits(self) -> Limits:
        """`limits`; while no worker ever reported any and requests wait for one, only what
        needs no worker is checked here: the worker it lands on checks the rest."""
        try:
            return self.limits()
        except NoWorkerAvailable:
            if not self._admission.waits_for_capacity:
                raise
            return Limits(
                max_model_len=_UNKNOWN_CONTEXT_LENGTH,
                max_tokens_limit=_UNKNOWN_CONTEXT_LENGTH,
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
        priority: int | None = None,
    ) -> Relay:
        """Validates, admits and starts a request; raises InvalidRequest, QueueFull or
        NoWorkerAvailable. A request_id that exists returns that request (no second start).
        ``priority``: the request's own order within its class on the engine (None: the
        default)."""
        check_request_id(request_id)
        relay = self.existing(request_id)
        if relay is not None:
            return relay
        try:
            limits = self._submit_limits()
            check_prompt_tokens(prompt_token_ids, limits)
            check_sampling(sampling, len(prompt_token_ids), limits)
            if priority is not None:
                check_priority(priority)
            request = GenerationRequest(
                request_id or f"req-{uuid.uuid4().hex}",
                prompt_token_ids,
                sampling,
                sla_class,
                tenant,
                priority,
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
        IndexOutOfRange, or InvalidRequest for an empty id."""
        if not request_id:
            raise InvalidRequest("request_id must not be empty: name the request to attach to")
        check_request_id(request_id)
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
            relay = self._relay_for(await self._adoption.request(route, self._owner_state))
            future.set_result(relay)
            return relay
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a lone caller re-raises it below
            raise
        finally:
            del self._adopting[request_id]

    def _relay_for(self, adopted: Adopted) -> Relay:
        """The relay of an adopted request: its output replayed from the store when it
        finished, else resumed on its owner (when that worker still runs it) or anywhere."""
        request = adopted.request
        started_by = adopted.record.owner_worker_id or "an unknown worker"
        if adopted.finished:
            relay = Relay(
                request, Ticket(request), self._admission, self._failover, self, self.tokenizer
            )
            relay.replay(adopted.output_ids, adopted.finish_reason)
            self._table.add(relay)
            log.warning(
                "request %s adopted finished (%d tokens, from %s): replayed from the store",
                request.request_id,
                len(adopted.output_ids),
                started_by,
            )
            return relay
        owner = self._registry.find(adopted.record.owner_worker_id) if adopted.on_owner else None
        ticket = (
            self._admission.place_on(request, owner)
            if owner is not None
            else self._admission.requeue(request, frozenset())
        )
        relay = Relay(request, ticket, self._admission, self._failover, self, self.tokenizer)
        self._table.add(relay)
        self._metrics.in_flight.inc()
        log.warning("request %s adopted (it ran on %s)", request.request_id, started_by)
        relay.start(adopted=True)
        return relay

    def _owner_state(self, worker_id: str) -> WorkerState | None:
        """The state of the worker with that id in the registry; None when it is unknown."""
        if not worker_id:
            return None
        try:
            return self._registry.find(worker_id).state
        except UnknownWorker:
            return None

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
        controller = self.batch_controller
        if controller is not None and relay.lease is not None and new_tokens:
            address, sla = relay.lease.entry.address, relay.request.sla_class
            if relay.delivered_tokens == new_tokens and relay.first_token_monotonic is not None:
                ttft = relay.first_token_monotonic - relay.created_monotonic
                controller.first_token(address, sla, relay.request_id, ttft)
                new_tokens -= 1
            controller.tokens(address, sla, relay.request_id, new_tokens)
        self._note(relay)

    def finished(self, relay: Relay) -> None:
        if isinstance(relay.error, NoWorkerInTime):
            # Turned away before it ran: its id is free for the client's retry.
            self._metrics.rejected.labels("no_worker_in_time").inc()
            self._table.forget(relay.request_id)
        self._failover.request_finished(relay.request_id)
        if self.batch_controller is not None:
            self.batch_controller.request_done(relay.request_id)
        self._metrics.in_flight.dec()
        ttft = tpot = None
        if relay.first_token_monotonic is not None:
            ttft = relay.first_token_monotonic - relay.created_monotonic
            if relay.delivered_tokens > 1 and relay.finished_monotonic is not None:
                decode_seconds = relay.finished_monotonic - relay.first_token_monotonic
                tpot = decode_seconds / (relay.delivered_tokens - 1)
        self._metrics.request_done(relay.request.sla_class, relay.finish_reason, ttft, tpot)
        self._note(relay)

    def unread(self, relay: Relay) -> None:
        """Every client of a running request left: unless one attaches again within the
        disconnect grace, the request is cancelled on its worker (whose finish deletes its
        keys), so that nobody's hang-up keeps a GPU decoding to max_tokens."""
        grace = self._disconnect_grace_seconds
        if self._stopping or not math.isfinite(grace):
            return
        if relay.request.sla_class == SlaClass.BATCH:
            return
        task = asyncio.get_running_loop().create_task(
            self._cancel_unread(relay, relay.readers_left, grace),
            name=f"unread-{relay.request_id}",
        )
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    async def _cancel_unread(self, relay: Relay, left: int, grace: float) -> None:
        await asyncio.sleep(grace)
        if self._stopping or relay.finished or relay.readers or relay.readers_left != left:
            return  # a client is back (or left again: its own grace runs), or it ended
        log.info(
            "request %s: no client for %.1f s after %d token(s); cancelled",
            relay.request_id,
            grace,
            relay.delivered_tokens,
        )
        self._metrics.disconnect_cancels.inc()
        try:
            await relay.cancel()
        except Exception as exc:  # logged; the request runs on
            log.warning(
                "request %s: cancel after its clients left failed: %s", relay.request_id, exc
            )

    def read_to_end(self, relay: Relay) -> None:
        """A reader got the end of a request that finished: the store may let its record and
        tokens go (it kept them for a client whose coordinator might die first)."""
        if self._adoption is None or relay.finish_reason not in _HELD_FINISHES:
            return
        task = asyncio.get_running_loop().create_task(self._adoption.release(relay.request_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

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

    def begin_stop(self) -> None:
        """The coordinator is stopping: clients cut off by the stop are not hang-ups (their
        requests stay resumable by the next coordinator), so nothing is cancelled for them."""
        self._stopping = True
        for task in list(self._orphans):
            task.cancel()

    async def stop(self) -> None:
        """After the fronts stopped: every relay lets go of its worker at once (each worker
        then pauses its request, resumable by the next coordinator), and pending releases
        are waited for."""
        self.begin_stop()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        await asyncio.gather(*(relay.stop() for relay in self._table))
        if self._adoption is not None:
            self._adoption.stop_retrying()
        await asyncio.gather(*self._releases, return_exceptions=True)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(RETENTION_SWEEP_INTERVAL_SECONDS)
            self._table.sweep()
