"""The grace-period flush planner: what to write, in which order, before the VM goes away.

When a notice arrives every running request has some state that is not yet in Redis: a few
uncommitted tokens and some KV (full blocks not saved yet plus the partial tail). The link to
Redis moves a known number of bytes per second and the deadline is fixed, so the order of the
writes decides how many requests end up complete (resumable with no recompute).

Order, and why::

    time ──▶ 0                                                        deadline
             │ tokens of every request │ KV r3 │ KV r1 │  KV r7  │ ... ┊  KV r2 (too late)
             └── one pipelined batch ──┘└── smallest KV first ──────────┘

1. Tokens first. Tokens are what the client has already seen; without them a request cannot
   continue at all, while missing KV only costs recompute. They are a few bytes per request,
   so they all go in one batch ahead of any KV. If even the tokens cannot all make it, the
   batch takes the requests with the fewest tokens first, which saves the most requests.
2. Then KV, smallest pending bytes first. With one shared link and one deadline, finishing
   the shortest jobs first maximises the number finished by the deadline (exchange argument:
   swapping a longer job ahead of a shorter one never finishes more jobs before a fixed
   time). KV of requests whose tokens cannot make it comes last, as best effort.

Within that discipline the plan is optimal: no order that saves all tokens first completes
more requests. The planner is pure: the caller measures throughput and passes the time left.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from store.constants import TOKEN_ID_BYTES
from worker.constants import TOKEN_WIRE_BYTES

# Sums of float durations in different orders differ in the last bits; a step that ends
# within this margin of the deadline counts as on time, so equal plans compare equal.
DEADLINE_TOLERANCE_SECONDS = 1e-9


@dataclass(frozen=True)
class PendingWork:
    """What one request still has to write to be complete in Redis."""

    request_id: str
    uncommitted_tokens: int
    kv_bytes: int
    """Bytes of KV not yet persisted: unsaved full blocks plus the partial tail."""

    def __post_init__(self) -> None:
        if self.uncommitted_tokens < 0 or self.kv_bytes < 0:
            raise ValueError(f"{self.request_id}: pending work must not be negative")

    @property
    def token_bytes(self) -> int:
        return self.uncommitted_tokens * (TOKEN_ID_BYTES + TOKEN_WIRE_BYTES)


@dataclass(frozen=True)
class LinkEstimate:
    """How fast state reaches Redis, as measured by the persister."""

    bytes_per_second: float
    round_trip_seconds: float = 0.0
    """Fixed cost of one write batch (network round trip); each KV write is one batch."""

    def __post_init__(self) -> None:
        if self.bytes_per_second <= 0:
            raise ValueError("bytes_per_second must be positive")
        if self.round_trip_seconds < 0:
            raise ValueError("round_trip_seconds must not be negative")

    def seconds_for(self, num_bytes: int) -> float:
        return num_bytes / self.bytes_per_second


class FlushKind(enum.Enum):
    TOKENS = "tokens"
    KV = "kv"


@dataclass(frozen=True)
class FlushStep:
    request_id: str
    kind: FlushKind
    num_bytes: int
    done_after_seconds: float
    """Expected time from now until this step is durable."""


@dataclass(frozen=True)
class FlushPlan:
    steps: tuple[FlushStep, ...]
    """Every pending write, in the order to issue them (token steps form one batch)."""
    expected_complete: frozenset[str]
    """Requests whose tokens and KV are expected in Redis before the deadline."""
    expected_tokens_safe: frozenset[str]
    """Requests whose tokens are expected in Redis before the deadline (a superset)."""


def plan_flush(
    pending: Sequence[PendingWork], link: LinkEstimate, seconds_left: float
) -> FlushPlan:
    """Order the pending writes so the most requests are complete before ``seconds_left``."""
    if len({work.request_id for work in pending}) != len(pending):
        raise ValueError("each request may appear once")
    deadline = max(0.0, seconds_left) + DEADLINE_TOLERANCE_SECONDS
    with_tokens = sorted(
        (work for work in pending if work.uncommitted_tokens),
        key=lambda work: (work.token_bytes, work.request_id),
    )

    # Tokens: the longest fewest-tokens-first prefix whose single batch beats the deadline.
    batch: list[PendingWork] = []
    batch_bytes = 0
    for work in with_tokens:
        if link.round_trip_seconds + link.seconds_for(batch_bytes + work.token_bytes) > deadline:
            break
        batch.append(work)
        batch_bytes += work.token_bytes
    batch_done = link.round_trip_seconds + link.seconds_for(batch_bytes) if batch else 0.0
    late_tokens = with_tokens[len(batch) :]
    tokens_safe = {work.request_id for work in pending} - {w.request_id for w in late_tokens}

    steps = [
        FlushStep(work.request_id, FlushKind.TOKENS, work.token_bytes, batch_done) for work in batch
    ]
    elapsed = batch_done
    for work in late_tokens:  # best effort: one more batch after the one that fits
        elapsed += link.seconds_for(work.token_bytes)
    if late_tokens:
        elapsed += link.round_trip_seconds
        steps += [
            FlushStep(work.request_id, FlushKind.TOKENS, work.token_bytes, elapsed)
            for work in late_tokens
        ]

    # KV: shortest first among requests whose tokens make it, then the rest.
    def kv_order(work: PendingWork) -> tuple[bool, int, str]:
        return (work.request_id not in tokens_safe, work.kv_bytes, work.request_id)

    kv_done: dict[str, float] = {}
    kv_elapsed = batch_done if not late_tokens else elapsed
    for work in sorted((w for w in pending if w.kv_bytes), key=kv_order):
        kv_elapsed += link.round_trip_seconds + link.seconds_for(work.kv_bytes)
        kv_done[work.request_id] = kv_elapsed
        steps.append(FlushStep(work.request_id, FlushKind.KV, work.kv_bytes, kv_elapsed))

    complete = {
        work.request_id
        for work in pending
        if work.request_id in tokens_safe and kv_done.get(work.request_id, 0.0) <= deadline
    }
    return FlushPlan(
        steps=tuple(steps),
        expected_complete=frozenset(complete),
        expected_tokens_safe=frozenset(tokens_safe),
    )
