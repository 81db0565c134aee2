"""How a request leaves a noticed or lost node — what the policies call: a staged migration,
a flush and load through the store, a recovery from the persisted blocks, a restart.

    notice ─▶ migrate_all ─┬─ stages fit the budget ─▶ targets prefetch stored blocks while
                           │                           the source decodes ─▶ switch (downtime)
                           └─ else ─▶ pause, flush partial blocks ─▶ target loads the context
    loss   ─▶ recover: load the full blocks, recompute the rest  │  restart: from the prompt
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from coordinator.constants import (
    STAGING_MAX_SECONDS,
    STAGING_MAX_SHARE,
    STAGING_MIN_LEFT_SECONDS,
)
from spotinfer.simulator.arrivals import SimRequest
from spotinfer.simulator.calibration import Calibration
from spotinfer.simulator.clock import Clock
from spotinfer.simulator.node import Node


@dataclass
class Pending:
    """How a queued, already admitted request goes on once it gets a slot."""

    available_at: float  # its KV (or nothing, for a restart) is ready from then
    load_seconds: float
    prefill_tokens: int
    have_tokens: int


@dataclass
class Counters:
    notices: int = 0
    kills: int = 0
    rejected: int = 0
    client_retries: int = 0
    staged_switches: int = 0
    flushed_moves: int = 0
    events_log: list[tuple[float, str, str]] = field(default_factory=list)


class Moves:
    """The movement half of `Simulation` (which provides the admission and node parts
    declared here)."""

    clock: Clock
    calibration: Calibration
    counters: Counters
    _delivered: dict[SimRequest, int]

    def _detach(self, request: SimRequest) -> int:
        raise NotImplementedError

    def _target(self, request: SimRequest, source: Node | None) -> Node | None:
        raise NotImplementedError

    def _move(
        self, request: SimRequest, target: Node, delay: float, prefill_tokens: int, have_tokens: int
    ) -> None:
        raise NotImplementedError

    def _requeue(self, request: SimRequest, pending: Pending) -> None:
        raise NotImplementedError

    def _pump(self) -> None:
        raise NotImplementedError

    def migrate_all(self, node: Node) -> None:
        """Every request of noticed ``node`` moves with its KV: staged (its target prefetches
        the persisted blocks while the source decodes, then a short switch) when the stages
        fit the coordinator's budget, else paused, its partial block flushed to the store, and
        loaded by the target. What a flush cannot save by the deadline is recovered from the
        persisted blocks."""
        calibration = self.calibration
        now = self.clock.now
        node.advance(now)
        assert node.deadline is not None
        left = node.deadline - now
        budget = min(STAGING_MAX_SECONDS, STAGING_MAX_SHARE * left)
        if left < STAGING_MIN_LEFT_SECONDS:
            budget = 0.0
        pairs: list[tuple[SimRequest, Node | None]] = []
        for request in sorted(node.running, key=lambda r: r.arrival):
            target = self._target(request, node)
            if target is not None:
                target.reserved += request.weight  # held through the stages or the flush
            pairs.append((request, target))
        targeted = [(r, t) for r, t in pairs if t is not None]
        # Each target prefetches the blocks eager persistence already stored; targets stage
        # side by side, so the slowest one sets the time.
        per_target: dict[Node, float] = collections.defaultdict(float)
        for request, target in targeted:
            persisted = self._persisted(request.prompt_tokens + node.tokens_of(request))
            per_target[target] += calibration.kv_megabytes(persisted * request.weight)
        stage_seconds = calibration.staging_overhead_seconds + (
            max(per_target.values(), default=0.0) / calibration.peer_mb_per_second
        )
        if targeted and len(targeted) == len(pairs) and budget > 0 and stage_seconds <= budget:
            self.clock.after(stage_seconds, self._switch, node, targeted)
            return
        self._flush(node, pairs)

    def _switch(self, node: Node, pairs: list[tuple[SimRequest, Node]]) -> None:
        for request, target in pairs:
            target.reserved -= request.weight
            if request.node is not node:
                continue  # it finished while staged
            tokens = self._detach(request)
            request.migrations += 1
            self.counters.staged_switches += 1
            self._move(request, target, self.calibration.switch_downtime_seconds, 0, tokens)
        self._pump()

    def _flush(self, node: Node, pairs: list[tuple[SimRequest, Node | None]]) -> None:
        calibration = self.calibration
        now = self.clock.now
        assert node.deadline is not None
        flushed_mb = 0.0
        for request, target in pairs:
            if target is not None:
                target.reserved -= request.weight  # _move holds it again
            tokens = self._detach(request)
            context = request.prompt_tokens + tokens
            # Full blocks are in the store already (eager persistence): the flush writes the
            # partial block of each request, one after the other through the node's link.
            tail = context - self._persisted(context)
            flushed_mb += calibration.kv_megabytes(tail * request.weight)
            stored_at = now + flushed_mb / calibration.store_write_mb_per_second
            if stored_at <= node.deadline:
                request.migrations += 1
                self.counters.flushed_moves += 1
                pending = Pending(
                    stored_at,
                    calibration.kv_megabytes(context * request.weight)
                    / calibration.store_read_mb_per_second,
                    0,
                    tokens,
                )
            else:
                pending = self._recovery(request, tokens, node.deadline)
            if target is None:
                self._requeue(request, pending)
            else:
                wait = max(0.0, pending.available_at - now) + pending.load_seconds
                self._move(request, target, wait, pending.prefill_tokens, pending.have_tokens)
        self._pump()

    def _persisted(self, context_tokens: int) -> int:
        """Tokens of a context whose KV eager persistence has stored: its full blocks."""
        block = self.calibration.block_tokens
        return context_tokens // block * block

    def _recovery(self, request: SimRequest, tokens: int, since: float) -> Pending:
        """Resume from what eager persistence stored: every full block; the rest is recomputed."""
        calibration = self.calibration
        context = request.prompt_tokens + tokens
        persisted = self._persisted(context)
        recompute = context - persisted
        request.recoveries += 1
        request.recomputed_tokens += recompute * request.weight
        load = (
            calibration.kv_megabytes(persisted * request.weight)
            / calibration.store_read_mb_per_second
        )
        return Pending(since, load, recompute, tokens)

    def recover(self, request: SimRequest) -> None:
        """``request`` lost its node without a flush: resume from the persisted blocks."""
        tokens = self._delivered.get(request, 0)
        pending = self._recovery(request, tokens, self.clock.now)
        target = self._target(request, None)
        if target is None:
            self._requeue(request, pending)
        else:
            self._move(request, target, pending.load_seconds, pending.prefill_tokens, tokens)

    def restart(self, request: SimRequest) -> None:
        """Starts ``request`` again from its prompt elsewhere (the relay drops the tokens the
        client has); it recomputes the prompt and every delivered token."""
        source = request.node
        if source is not None:
            self._detach(request)
        delivered = self._delivered.get(request, 0)
        request.restarts += 1
        request.recomputed_tokens += (request.prompt_tokens + delivered) * request.weight
        target = self._target(request, source)
        delay = self.calibration.request_overhead_seconds
        if target is None:
            self._requeue(request, Pending(self.clock.now, delay, request.prompt_tokens, 0))
        else:
            self._move(request, target, delay, request.prompt_tokens, 0)
