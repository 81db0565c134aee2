"""One simulated node: its lifecycle and its decode, as a fluid of steps.

Between two events a node's batch does not change, so every running sequence advances at the
same rate, one token per step. The node keeps one counter, ``v`` (steps taken), and each
request the step count at which it finishes; a prefill (or recompute) holds the whole node:

    v ──▶ ┌ stall (prefill k tokens) ┐ step step step … (step time from the batch) ──▶
          └ no step while stalled    ┘  request done when v reaches its target_v

    BOOTING ─▶ STANDBY ─▶ ACTIVE ─▶ NOTICED ─▶ GONE          (DRAINING: an on-demand node
          └───────────▶ ACTIVE                                retired once spot returns)
"""

from __future__ import annotations

import enum
import heapq

from spotinfer.simulator.arrivals import SimRequest
from spotinfer.simulator.calibration import Calibration

FINISH_EPSILON_STEPS = 1e-9


class NodeState(enum.Enum):
    BOOTING = "booting"
    STANDBY = "standby"
    ACTIVE = "active"
    NOTICED = "noticed"  # the cloud will take it at its deadline: out of routing
    DRAINING = "draining"  # we retire it: out of routing, its requests finish
    GONE = "gone"


class Market(str, enum.Enum):
    SPOT = "spot"
    ON_DEMAND = "on-demand"


class Node:
    def __init__(
        self,
        node_id: str,
        zone: str,
        market: Market,
        calibration: Calibration,
        launched_at: float,
        state: NodeState = NodeState.BOOTING,
    ) -> None:
        self.node_id = node_id
        self.zone = zone
        self.market = market
        self.calibration = calibration
        self.state = state
        self.launched_at = launched_at
        self.gone_at: float | None = None
        self.deadline: float | None = None  # NOTICED: when the cloud takes it
        self.running: set[SimRequest] = set()
        self.reserved = 0  # slots held for requests moving here (weights)
        self.batch = 0  # weights of the running requests
        self.context_tokens = 0.0  # their mean context, weighted
        self.v = 0.0
        self.last_t = launched_at
        self.stall_until = launched_at
        self.version = 0  # bumped whenever the next finish may have changed
        self._finishes: list[tuple[float, int, int, SimRequest]] = []  # target, seq, placement
        self._seq = 0

    # -- queries ---------------------------------------------------------------------------

    @property
    def routable(self) -> bool:
        return self.state == NodeState.ACTIVE

    @property
    def in_flight(self) -> int:
        return self.batch + self.reserved

    @property
    def free_slots(self) -> int:
        return self.calibration.max_num_seqs - self.in_flight

    def step_seconds(self) -> float:
        return self.calibration.step_seconds(self.batch, self.context_tokens)

    def tokens_of(self, request: SimRequest) -> int:
        """Output tokens ``request`` has in its context here (call after ``advance``)."""
        if self.last_t < request.ready_at:
            return request.have_tokens  # its prefill is still running
        steps = int(self.v - request.start_v + FINISH_EPSILON_STEPS)
        return min(request.output_tokens, request.have_tokens + 1 + steps)

    # -- the fluid -------------------------------------------------------------------------

    def advance(self, now: float) -> None:
        """Steps taken up to ``now``."""
        if now <= self.last_t:
            return
        start = max(self.last_t, self.stall_until)
        if now > start and self.batch:
            self.v += (now - start) / self.step_seconds()
        self.last_t = now

    def admit(
        self, request: SimRequest, now: float, prefill_tokens: int, have_tokens: int
    ) -> float:
        """``request`` joins the batch with ``have_tokens`` output tokens already in its
        context, after ``prefill_tokens`` are computed; returns when its first new token comes.
        Call ``advance(now)`` first."""
        tokens = max(1, prefill_tokens)
        stall_from = max(self.stall_until, now)
        self.stall_until = stall_from + self.calibration.prefill_seconds(tokens * request.weight)
        request.node = self
        request.placement += 1
        request.have_tokens = have_tokens
        request.start_v = self.v
        if request.weight == 1:
            request.ready_at = self.stall_until
        else:
            # A cohort stands for requests that arrived spread out: their prefills hold the
            # node for all of them, but each one's first token comes after its own, and not
            # after another cohort's (which in truth interleave with it).
            request.ready_at = now + self.calibration.prefill_seconds(tokens)
        # The prefill makes the first new token; each step after it one more.
        request.target_v = self.v + max(0, request.output_tokens - have_tokens - 1)
        self.running.add(request)
        self.batch += request.weight
        self.context_tokens += _mean_context(request) * request.weight
        self._seq += 1
        heapq.heappush(self._finishes, (request.target_v, self._seq, request.placement, request))
        self.version += 1
        return request.ready_at

    def remove(self, request: SimRequest) -> int:
        """Takes ``request`` out (it moves or its node is gone); returns the output tokens it
        had here. Call ``advance(now)`` first."""
        tokens = self.tokens_of(request)
        if self.last_t < request.ready_at and request.first_token_at == request.ready_at:
            request.first_token_at = None  # its first token never came
        self.running.discard(request)
        self.batch -= request.weight
        self.context_tokens -= _mean_context(request) * request.weight
        if not self.running:
            self.context_tokens = 0.0
        request.node = None
        request.placement += 1  # its heap entry is stale now
        self.version += 1
        return tokens

    def next_finish_time(self) -> float | None:
        """When the first running request finishes, if the batch stays as it is."""
        finishes = self._finishes
        while finishes and finishes[0][2] != finishes[0][3].placement:
            heapq.heappop(finishes)
        if not finishes:
            return None
        steps_left = max(0.0, finishes[0][0] - self.v)
        return max(self.last_t, self.stall_until) + steps_left * self.step_seconds()

    def pop_finished(self) -> list[SimRequest]:
        """Requests whose last token is out (call after ``advance``)."""
        done = []
        finishes = self._finishes
        while finishes:
            target, _, placement, request = finishes[0]
            if placement != request.placement:
                heapq.heappop(finishes)
                continue
            if target > self.v + FINISH_EPSILON_STEPS or self.stall_until > self.last_t:
                break
            heapq.heappop(finishes)
            done.append(request)
        for request in done:
            self.remove(request)
        return done


def _mean_context(request: SimRequest) -> float:
    """The context a request has on average while it decodes (prompt + half its output): the
    step model's KV read, held constant so that the batch's step time only changes at events."""
    return request.prompt_tokens + request.output_tokens / 2
