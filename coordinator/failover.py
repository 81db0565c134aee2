"""What happens to an in-flight request when its worker stream breaks or its worker is noticed.

The relay has one place that handles an interruption (`Relay._run`); it asks the failover
policy for a new source of tokens. The relay then dedupes by index, so whatever the new
source repeats is dropped and the client still sees 0..n-1 once each.

    worker stream ends without a finish ─┐
    heartbeat says LOST ─────────────────┼─▶ Interruption ─▶ policy.take_over ─▶ Takeover
    stream paused by a notice (NOTICE) ──┘                   (new lease + its token stream)

Policies register by name (`--failover-policy`):
- ``fail``: the request ends with FinishReason.ERROR (workers without persistence);
- ``resume``: another worker continues it from the persisted state with Worker.Resume (needs
  workers running with `--redis-url`); a request of which the store holds nothing and the
  client has no token yet (the lost worker never started it) starts afresh there. A request
  paused by a notice first waits for its flush to be complete (see migration.py), so the
  target loads every token's KV and recomputes nothing; if no worker has room it waits in
  the head of its queue rather than fail.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

from common.requests import Event, EventKind, GenerationRequest, TokenChunk
from coordinator.admission import Admission, Lease
from coordinator.errors import NothingPersisted, RequestLost
from coordinator.migration import Migrations
from store import RequestStore, StoreUnavailable

log = logging.getLogger(__name__)


class InterruptionKind(enum.Enum):
    STREAM_BROKEN = "stream_broken"  # the stream failed or ended without a finish
    WORKER_LOST = "worker_lost"  # the heartbeat stopped
    NOTICE = "notice"  # a termination notice paused the request: the worker persists it


@dataclass(frozen=True)
class Interruption:
    kind: InterruptionKind
    worker_id: str
    detail: str


@dataclass
class Takeover:
    """Where the request goes on: the new slot and the stream of its tokens."""

    lease: Lease
    chunks: AsyncIterator[TokenChunk]


class FailoverPolicy:
    """``take_over`` returns the new source for ``request``, whose output tokens
    ``delivered`` the client already has; it raises RequestLost when the request cannot go
    on. It may call the broken worker (best effort) but never releases ``lost``: the relay
    does. ``attempt`` counts interruptions of this request, from 1."""

    _by_name: ClassVar[dict[str, type[FailoverPolicy]]] = {}
    name: ClassVar[str]
    # Whether a notice injected by a drill makes the worker's daemon flush (pause and persist
    # every request): only worth it when paused requests can move. Otherwise the worker just
    # leaves routing, and its requests run on until it really goes.
    acts_on_notice: ClassVar[bool] = False

    def __init_subclass__(cls, name: str, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if name in FailoverPolicy._by_name:
            raise ValueError(f"failover policy {name!r} is already registered")
        cls.name = name
        FailoverPolicy._by_name[name] = cls

    def __init__(
        self,
        admission: Admission,
        migrations: Migrations | None = None,
        store: RequestStore | None = None,
    ) -> None:
        self._admission = admission
        self._migrations = migrations
        self._store = store

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(sorted(cls._by_name))

    @classmethod
    def create(
        cls,
        name: str,
        admission: Admission,
        migrations: Migrations | None = None,
        store: RequestStore | None = None,
    ) -> FailoverPolicy:
        try:
            policy_class = cls._by_name[name]
        except KeyError:
            raise ValueError(
                f"unknown failover policy {name!r}; known: {', '.join(cls.names())}"
            ) from None
        return policy_class(admission, migrations, store)

    async def take_over(
        self,
        request: GenerationRequest,
        delivered: Sequence[int],
        lost: Lease,
        why: Interruption,
        attempt: int,
    ) -> Takeover:
        raise NotImplementedError

    def request_finished(self, request_id: str) -> None:
        """The request ended (any way): whatever the policy prepared for it can go."""


class FailRequest(FailoverPolicy, name="fail"):
    async def take_over(
        self,
        request: GenerationRequest,
        delivered: Sequence[int],
        lost: Lease,
        why: Interruption,
        attempt: int,
    ) -> Takeover:
        raise RequestLost(
            f"worker {why.worker_id} failed ({why.kind.value}: {why.detail}) after "
            f"{len(delivered)} tokens, and this coordinator does not fail over "
            "(--failover-policy fail)"
        )


class ResumeFromStore(FailoverPolicy, name="resume"):
    MAX_ATTEMPTS = 3
    acts_on_notice = True

    async def take_over(
        self,
        request: GenerationRequest,
        delivered: Sequence[int],
        lost: Lease,
        why: Interruption,
        attempt: int,
    ) -> Takeover:
        if why.kind == InterruptionKind.NOTICE:
            # Any number of noticed preemptions: each is planned, none counts as a failure.
            return await self._migrate(request, delivered, lost)
        if attempt > self.MAX_ATTEMPTS:
            raise RequestLost(f"gave up after {self.MAX_ATTEMPTS} failovers: {why.detail}")
        # A source that died mid-handshake: its staged target recovers it.
        lease = self._prepared(request.request_id)
        if lease is None:
            lease = self._admission.place_elsewhere(
                request, frozenset({lost.entry.address}), lost.entry.pool
            )
        if lease is None:
            raise RequestLost(f"no worker left to continue on after {why.detail}")
        if self._migrations is not None:
            await self._migrations.settle_lost(lost.entry)
        log.warning(
            "request %s: %s on %s; resuming on %s from index %d",
            request.request_id,
            why.kind.value,
            why.worker_id,
            lease.entry.worker_id,
            len(delivered),
        )
        return Takeover(lease, _resume_or_start(lease, request, delivered))

    async def _migrate(
        self, request: GenerationRequest, delivered: Sequence[int], source: Lease
    ) -> Takeover:
        """The source paused the request on a notice: once the store holds all of it, the
        next worker resumes it (MIGRATED, nothing recomputed). Without a complete flush
        (the source died, the deadline passed) the same call recovers what is stored."""
        report = None
        if self._migrations is not None:
            report = await self._migrations.wait_flushed(request.request_id, source.entry)
        if report is None or not report.complete:
            log.warning(
                "request %s: flush on %s not complete (%s); recovering from the store",
                request.request_id,
                source.entry.worker_id,
                report,
            )
        lease = self._prepared(request.request_id)
        staged = lease is not None
        if lease is None:
            ticket = self._admission.requeue(
                request, frozenset({source.entry.address}), source.entry.pool
            )
            lease = await self._admission.wait(ticket)
        log.info(
            "request %s: migrating from %s to %s at index %d (%s)",
            request.request_id,
            source.entry.worker_id,
            lease.entry.worker_id,
            len(delivered),
            "staged" if staged else "not staged",
        )
        return Takeover(lease, _resume_or_start(lease, request, delivered))

    def _prepared(self, request_id: str) -> Lease | None:
        return self._migrations.take_prepared(request_id) if self._migrations else None

    def request_finished(self, request_id: str) -> None:
        if self._migrations is not None:
            self._migrations.abandon(request_id, "it finished")


async def _resume_or_start(
    lease: Lease, request: GenerationRequest, delivered: Sequence[int]
) -> AsyncIterator[TokenChunk]:
    """Worker.Resume from prompt + the client's tokens (``delivered``: with sampling, the
    store's copy may lag them, and the continuation must follow what the client saw); when
    the store has no record and the client has no token yet (the lost worker never started
    the request), a plain Generate on the new worker instead."""
    client = lease.entry.client
    try:
        async for chunk in client.resume(request.request_id, len(delivered), delivered, request):
            yield chunk
        return
    except NothingPersisted:
        if delivered:
            raise RequestLost(
                f"request {request.request_id}: {len(delivered)} tokens were delivered but "
                "the store holds no record of it (its worker ran without --redis-url?)"
            ) from None
    log.warning("request %s: nothing persisted; starting it afresh", request.request_id)
    async for chunk in client.generate(request):
        yield chunk


class RerouteFromScratch(FailoverPolicy, name="reroute"):
    async def _forget(self, request_id: str) -> None:
        if self._store is not None:
            await _forget_in(self._store, request_id)

    """The baseline other stacks give: an interrupted request starts again from its prompt
    on another worker (what a client retry does), recomputing everything; the relay drops
    the tokens the client already has. Notices are not acted on."""

    MAX_ATTEMPTS = 10

    async def take_over(
        self,
        request: GenerationRequest,
        delivered: Sequence[int],
        lost: Lease,
        why: Interruption,
        attempt: int,
    ) -> Takeover:
        if attempt > self.MAX_ATTEMPTS:
            raise RequestLost(f"gave up after {self.MAX_ATTEMPTS} restarts: {why.detail}")
        ticket = self._admission.requeue(request, frozenset({lost.entry.address}), lost.entry.pool)
        lease = await self._admission.wait(ticket)
        # A fresh id on the worker: the interrupted attempt may have left state under the
        # old one, and a restart must not pick it up. That state is dropped: nothing will
        # ever resume it (it would otherwise stay in Redis until its TTL).
        restarted = dataclasses.replace(request, request_id=f"{request.request_id}.r{attempt}")
        interrupted = request.request_id if attempt == 1 else f"{request.request_id}.r{attempt - 1}"
        await self._forget(interrupted)
        log.warning(
            "request %s: %s on %s; restarting from scratch on %s",
            request.request_id,
            why.kind.value,
            why.worker_id,
            lease.entry.worker_id,
        )
        return Takeover(lease, _restart(lease, restarted, request.request_id, len(delivered), why))


async def _forget_in(store: RequestStore, request_id: str) -> None:
    try:
        await asyncio.to_thread(store.delete_request, request_id)
    except StoreUnavailable as exc:
        log.warning("request %s: its abandoned state stays in Redis (%s)", request_id, exc)


async def _restart(
    lease: Lease,
    restarted: GenerationRequest,
    request_id: str,
    delivered_tokens: int,
    why: Interruption,
) -> AsyncIterator[TokenChunk]:
    # Said on the stream like a recovery, with what the restart costs: the whole prompt and
    # every token already delivered are computed again.
    yield TokenChunk(
        request_id=request_id,
        index=delivered_tokens,
        event=Event(
            kind=EventKind.RECOVERED,
            from_worker=why.worker_id,
            to_worker=lease.entry.worker_id,
            recomputed_tokens=len(restarted.prompt_token_ids) + delivered_tokens,
            detail="rerouted: restarted from scratch",
        ),
        worker_id=lease.entry.worker_id,
    )
    async for chunk in lease.entry.client.generate(restarted):
        yield dataclasses.replace(chunk, request_id=request_id)
