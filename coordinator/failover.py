"""What happens to an in-flight request when its worker stream breaks or its worker is noticed.

The relay has one place that handles an interruption (`Relay._run`); it asks the failover
policy for a new source of tokens. The relay then dedupes by index, so whatever the new
source repeats is dropped and the client still sees 0..n-1 once each.

    worker stream ends without a finish ─┐
    heartbeat says LOST ─────────────────┼─▶ Interruption ─▶ policy.take_over ─▶ Takeover
    termination notice (InjectNotice) ───┘                   (new lease + its token stream)

Policies register by name (`--failover-policy`):
- ``fail``: the request ends with FinishReason.ERROR (workers without persistence);
- ``resume``: another worker continues it from the persisted state with Worker.Resume (needs
  workers running with `--redis-url`); a request of which the store holds nothing and the
  client has no token yet (the lost worker never started it) starts afresh there. On a notice the source is stopped first; a full
  multi-stage live migration (pre-allocate on the standby, copy while decoding, pause at an
  iteration boundary) is a policy still to come, plugged in here.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import ClassVar

import grpc

from coordinator.admission import Admission, Lease
from coordinator.errors import NothingPersisted, RequestLost
from spotinfer.requests import GenerationRequest, TokenChunk

log = logging.getLogger(__name__)


class InterruptionKind(enum.Enum):
    STREAM_BROKEN = "stream_broken"  # the stream failed or ended without a finish
    WORKER_LOST = "worker_lost"  # the heartbeat stopped
    NOTICE = "notice"  # a termination notice: the worker still runs, for now


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
    """``take_over`` returns the new source for ``request``, whose first ``delivered_tokens``
    output tokens the client already has; it raises RequestLost when the request cannot go
    on. It may call the broken worker (best effort) but never releases ``lost``: the relay
    does. ``attempt`` counts interruptions of this request, from 1."""

    _by_name: ClassVar[dict[str, type[FailoverPolicy]]] = {}
    name: ClassVar[str]
    # Whether a termination notice moves requests at once (else they run on until the
    # worker really goes, and a broken stream or a lost heartbeat brings them here).
    acts_on_notice: ClassVar[bool] = False

    def __init_subclass__(cls, name: str, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if name in FailoverPolicy._by_name:
            raise ValueError(f"failover policy {name!r} is already registered")
        cls.name = name
        FailoverPolicy._by_name[name] = cls

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(sorted(cls._by_name))

    @classmethod
    def create(cls, name: str, admission: Admission) -> FailoverPolicy:
        try:
            policy_class = cls._by_name[name]
        except KeyError:
            raise ValueError(
                f"unknown failover policy {name!r}; known: {', '.join(cls.names())}"
            ) from None
        return policy_class(admission)

    async def take_over(
        self,
        request: GenerationRequest,
        delivered_tokens: int,
        lost: Lease,
        why: Interruption,
        attempt: int,
    ) -> Takeover:
        raise NotImplementedError


class FailRequest(FailoverPolicy, name="fail"):
    async def take_over(
        self,
        request: GenerationRequest,
        delivered_tokens: int,
        lost: Lease,
        why: Interruption,
        attempt: int,
    ) -> Takeover:
        raise RequestLost(
            f"worker {why.worker_id} failed ({why.kind.value}: {why.detail}) after "
            f"{delivered_tokens} tokens, and this coordinator does not fail over "
            "(--failover-policy fail)"
        )


class ResumeFromStore(FailoverPolicy, name="resume"):
    MAX_ATTEMPTS = 3
    acts_on_notice = True

    async def take_over(
        self,
        request: GenerationRequest,
        delivered_tokens: int,
        lost: Lease,
        why: Interruption,
        attempt: int,
    ) -> Takeover:
        if attempt > self.MAX_ATTEMPTS:
            raise RequestLost(f"gave up after {self.MAX_ATTEMPTS} failovers: {why.detail}")
        if why.kind == InterruptionKind.NOTICE:
            # The source still decodes: stop it so two workers never write one request.
            with contextlib.suppress(grpc.aio.AioRpcError):
                await lost.entry.client.abort(request.request_id)
        lease = self._admission.place_elsewhere(request, frozenset({lost.entry.address}))
        if lease is None:
            raise RequestLost(f"no worker left to continue on after {why.detail}")
        log.warning(
            "request %s: %s on %s; resuming on %s from index %d",
            request.request_id,
            why.kind.value,
            why.worker_id,
            lease.entry.worker_id,
            delivered_tokens,
        )
        return Takeover(lease, _resume_or_start(lease, request, delivered_tokens))


async def _resume_or_start(
    lease: Lease, request: GenerationRequest, delivered_tokens: int
) -> AsyncIterator[TokenChunk]:
    """Worker.Resume; when the store has no record and the client has no token yet (the lost
    worker never started the request), a plain Generate on the new worker instead."""
    client = lease.entry.client
    try:
        async for chunk in client.resume(request.request_id, delivered_tokens):
            yield chunk
        return
    except NothingPersisted:
        if delivered_tokens:
            raise RequestLost(
                f"request {request.request_id}: {delivered_tokens} tokens were delivered but "
                "the store holds no record of it (its worker ran without --redis-url?)"
            ) from None
    log.warning("request %s: nothing persisted; starting it afresh", request.request_id)
    async for chunk in client.generate(request):
        yield chunk
