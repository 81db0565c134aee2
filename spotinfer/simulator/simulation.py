"""The simulation: requests arriving, admission and routing, nodes decoding, and what a
notice or a loss does to the requests on a node — the coordinator's policies over a fleet.

    arrival ─▶ admission (INTERACTIVE first, per-class queues) ─▶ least-loaded active node
    node: prefill ─ steps ─ finish ─▶ a freed slot pumps the queues
    capacity drop ─▶ notice (grace) ─▶ policy.on_notice: migrate (stage / flush) or restart
                  └─▶ deadline: the node is gone ─▶ policy.on_loss: recover or restart
    fleet.plan after every change: launch spot where there is room, on-demand fallback, retire

A moving request holds a slot on its target from the moment it is chosen, and joins the
target's batch when its KV is there (staged switch, flush + load, or recovery) or, for a
restart, after the new call's set-up.
"""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.requests import SlaClass
from coordinator.constants import (
    DEFAULT_BATCH_QUEUE_CAPACITY,
    DEFAULT_INTERACTIVE_QUEUE_CAPACITY,
)
from spotinfer.loadgen import REATTACH_ATTEMPTS, REATTACH_BACKOFF_SECONDS
from spotinfer.simulator.arrivals import SimRequest
from spotinfer.simulator.calibration import Calibration
from spotinfer.simulator.clock import Clock
from spotinfer.simulator.fleet import Fleet, FleetSpec
from spotinfer.simulator.moves import Counters, Moves, Pending
from spotinfer.simulator.node import Market, Node, NodeState
from spotinfer.simulator.policies import Policy
from spotinfer.simulator.traces import AvailabilityTrace

SERVICE_ORDER = (SlaClass.INTERACTIVE, SlaClass.BATCH)
# A client that found no worker at all comes back (Generate → UNAVAILABLE → Attach → NOT_FOUND
# → Generate): two back-offs of the load generator.
CLIENT_RETRY_SECONDS = 2 * REATTACH_BACKOFF_SECONDS
DRAIN_SECONDS = 3600.0  # after the last arrival, requests may finish for this long
# The autoscaler measures the load this often, and asks for the nodes that keep it under this
# utilization (assumption; on-demand fallback only buys nodes the load needs).
AUTOSCALE_INTERVAL_SECONDS = 60.0
TARGET_UTILIZATION = 0.8


@dataclass(frozen=True)
class SimConfig:
    fleet: FleetSpec
    grace_seconds: float = 120.0  # a notice's lead time (AWS: 120 s)
    queue_capacity: dict[SlaClass, int] = field(
        default_factory=lambda: {
            SlaClass.INTERACTIVE: DEFAULT_INTERACTIVE_QUEUE_CAPACITY,
            SlaClass.BATCH: DEFAULT_BATCH_QUEUE_CAPACITY,
        }
    )
    seed: int = 0
    drain_seconds: float = DRAIN_SECONDS

    def __post_init__(self) -> None:
        if self.grace_seconds < 0 or self.drain_seconds < 0:
            raise ValueError("grace and drain must not be negative")


@dataclass(frozen=True)
class ClusterAction:
    """A scripted change (a drill's schedule): ``notice`` / ``kill`` an existing node, or a
    node ``join`` (it boots, then waits as a standby)."""

    time_seconds: float
    kind: str
    node_id: str
    grace_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("notice", "kill", "join"):
            raise ValueError(f"unknown cluster action {self.kind!r}")


@dataclass(frozen=True)
class InitialNode:
    node_id: str
    state: NodeState  # ACTIVE or STANDBY
    market: Market = Market.SPOT
    zone: str = "a"


class Simulation(Moves):
    def __init__(
        self,
        config: SimConfig,
        calibration: Calibration,
        policy: Policy,
        requests: Sequence[SimRequest],
        trace: AvailabilityTrace,
        script: Sequence[ClusterAction] = (),
        initial: Sequence[InitialNode] | None = None,
        log_events: bool = False,
    ) -> None:
        self.config = config
        self.calibration = calibration
        self.policy = policy
        self.requests = list(requests)
        self.trace = trace
        self.clock = Clock()
        self.fleet = Fleet(
            config.fleet, policy, calibration, trace.initial, random.Random(config.seed)
        )
        self.counters = Counters()
        self._log = log_events
        self._queues: dict[SlaClass, collections.deque[SimRequest]] = {
            sla: collections.deque() for sla in SlaClass
        }
        self._pending: dict[SimRequest, Pending] = {}
        self._delivered: dict[SimRequest, int] = {}  # tokens the client has, once interrupted
        self._attempts: dict[SimRequest, int] = {}
        self._outstanding = len(self.requests)
        self._demand_nodes: int | None = None  # unknown until the first measurement
        self._arrived_work_seconds = 0.0  # node-seconds of the requests since the last tick
        self.end_seconds = 0.0
        self._start(initial, script)

    # -- set-up ----------------------------------------------------------------------------

    def _start(
        self, initial: Sequence[InitialNode] | None, script: Sequence[ClusterAction]
    ) -> None:
        if initial is not None:
            for spec in initial:
                node = self.fleet.launch(spec.market, spec.zone, 0.0, spec.state, spec.node_id)
                node.last_t = node.stall_until = 0.0
        else:  # the fleet as it stands at the start: every node ready
            self.fleet.plan(self._launch_ready, self._retire)
            if self.config.fleet.autoscale:
                self.clock.at(AUTOSCALE_INTERVAL_SECONDS, self._autoscale)
        # Arrivals enter the clock one at a time (each schedules the next): the heap stays the
        # size of what is in flight, not of the whole day.
        self._arrivals = sorted(self.requests, key=lambda r: r.arrival)
        if self._arrivals:
            self._schedule_arrival(0)
        for event in self.trace.events:
            self.clock.at(event.time_seconds, self._capacity, event.zone, event.capacity)
        for action in script:
            self.clock.at(action.time_seconds, self._scripted, action)

    def _launch_ready(self, market: Market, zone: str) -> None:
        serving = market == Market.ON_DEMAND or len(self.fleet.active) < self.config.fleet.nodes
        state = NodeState.ACTIVE if serving else NodeState.STANDBY
        self.fleet.launch(market, zone, 0.0, state)

    # -- running ---------------------------------------------------------------------------

    def run(self, on_progress: Callable[[float, float], None] | None = None) -> None:
        """Until every request is done (or rejected), at most until the last arrival plus
        the drain time; ``on_progress(now, horizon)`` between slices."""
        last_arrival = max((r.arrival for r in self.requests), default=0.0)
        horizon = max(last_arrival, self.trace.span_seconds) + self.config.drain_seconds
        slice_seconds = max(1.0, horizon / 200)
        now = 0.0
        while now < horizon and (self._outstanding > 0 or now <= last_arrival):
            now = min(horizon, now + slice_seconds)
            self.clock.run(until=now)
            if on_progress is not None:
                on_progress(now, horizon)
            if self._outstanding == 0 and now > last_arrival:
                break
        finished = [r.finished_at for r in self.requests if r.finished_at is not None]
        self.end_seconds = max([last_arrival, *finished])

    # -- arrivals and admission ------------------------------------------------------------

    def _autoscale(self) -> None:
        """Every interval: the nodes the last interval's load needs, or what is in flight."""
        calibration = self.calibration
        busy = self._arrived_work_seconds / AUTOSCALE_INTERVAL_SECONDS / TARGET_UTILIZATION
        in_flight = sum(n.in_flight for n in self.fleet.nodes) + sum(
            r.weight for q in self._queues.values() for r in q
        )
        self._demand_nodes = max(math.ceil(busy), math.ceil(in_flight / calibration.max_num_seqs))
        self._arrived_work_seconds = 0.0
        self._plan()
        if self._outstanding > 0:
            self.clock.after(AUTOSCALE_INTERVAL_SECONDS, self._autoscale)

    def _work_seconds(self, request: SimRequest) -> float:
        """A node's time for ``request`` at a full batch (the load's measure)."""
        calibration = self.calibration
        batch = calibration.max_num_seqs
        context = request.prompt_tokens + request.output_tokens / 2
        step = calibration.step_seconds(batch, batch * context)
        decode = request.output_tokens * step / batch
        return (decode + calibration.prefill_seconds(request.prompt_tokens)) * request.weight

    def _schedule_arrival(self, index: int) -> None:
        request = self._arrivals[index]
        overhead = self.calibration.request_overhead_seconds
        self.clock.at(request.arrival + overhead, self._arrive_next, index)

    def _arrive_next(self, index: int) -> None:
        if index + 1 < len(self._arrivals):
            self._schedule_arrival(index + 1)
        self._arrive(self._arrivals[index])

    def _arrive(self, request: SimRequest) -> None:
        if request not in self._attempts:
            self._arrived_work_seconds += self._work_seconds(request)
        if not self.fleet.active and self.fleet.promote() is None:
            attempts = self._attempts.get(request, 0) + 1
            self._attempts[request] = attempts
            if attempts > REATTACH_ATTEMPTS:
                self._reject(request)
            else:
                self.counters.client_retries += 1
                self.clock.after(CLIENT_RETRY_SECONDS, self._arrive, request)
            return
        queue = self._queues[request.sla_class]
        if not queue:
            node = self._place(request)
            if node is not None:
                self._begin(request, node, request.prompt_tokens, 0)
                return
        if len(queue) >= self.config.queue_capacity[request.sla_class]:
            self._reject(request)
            return
        queue.append(request)

    def _reject(self, request: SimRequest) -> None:
        request.rejected = True
        self.counters.rejected += 1
        self._outstanding -= 1

    def _place(
        self, request: SimRequest, exclude: Node | None = None, avoid_zone: str | None = None
    ) -> Node | None:
        """The least-loaded active node with room (outside ``avoid_zone`` first). The hottest
        loop of a run: plain attribute reads only."""
        limit = self.calibration.max_num_seqs - request.weight
        best: Node | None = None
        best_load = limit + 1
        if avoid_zone is None:
            for node in self.fleet.active:
                load = node.batch + node.reserved
                if load < best_load and node is not exclude:
                    best, best_load = node, load
            return best
        best_key = (True, best_load)
        for node in self.fleet.active:
            load = node.batch + node.reserved
            if load > limit or node is exclude:
                continue
            key = (node.zone == avoid_zone, load)
            if key < best_key:
                best, best_key = node, key
        return best

    def _target(self, request: SimRequest, source: Node | None) -> Node | None:
        """Where a moving request goes: a node with room, else a promoted standby."""
        zone = source.zone if source is not None else None
        node = self._place(request, source, zone)
        return node if node is not None else self.fleet.promote(zone, source)

    def _pump(self) -> None:
        for sla in SERVICE_ORDER:
            queue = self._queues[sla]
            while queue:
                request = queue[0]
                node = self._place(request)
                if node is None and not self.fleet.active:
                    node = self.fleet.promote()
                if node is None:
                    break
                queue.popleft()
                pending = self._pending.pop(request, None)
                if pending is None:
                    self._begin(request, node, request.prompt_tokens, 0)
                else:
                    wait = max(0.0, pending.available_at - self.clock.now) + pending.load_seconds
                    self._move(request, node, wait, pending.prefill_tokens, pending.have_tokens)

    def _requeue(self, request: SimRequest, pending: Pending) -> None:
        """An admitted request with no slot anywhere: the head of its queue, beyond capacity."""
        self._pending[request] = pending
        self._queues[request.sla_class].appendleft(request)

    # -- a node's decode -------------------------------------------------------------------

    def _begin(
        self, request: SimRequest, node: Node, prefill_tokens: int, have_tokens: int
    ) -> None:
        node.advance(self.clock.now)
        ready = node.admit(request, self.clock.now, prefill_tokens, have_tokens)
        if request.first_token_at is None:
            request.first_token_at = ready
        self._schedule(node)

    def _schedule(self, node: Node) -> None:
        when = node.next_finish_time()
        if when is not None:
            self.clock.at(when, self._on_node, node, node.version)

    def _on_node(self, node: Node, version: int) -> None:
        if version != node.version or node.state == NodeState.GONE:
            return
        node.advance(self.clock.now)
        for request in node.pop_finished():
            request.finished_at = self.clock.now
            self._outstanding -= 1
        if node.state == NodeState.DRAINING and node.in_flight == 0:
            self._gone(node)
        else:
            self._schedule(node)
        self._pump()

    def _detach(self, request: SimRequest) -> int:
        """Takes a request off its node; the output tokens its context holds there."""
        node = request.node
        assert node is not None, f"{request} is on no node"
        node.advance(self.clock.now)
        tokens = node.remove(request)
        self._delivered[request] = max(self._delivered.get(request, 0), tokens)
        self._schedule(node)
        return tokens

    def _move(
        self, request: SimRequest, target: Node, delay: float, prefill_tokens: int, have_tokens: int
    ) -> None:
        target.reserved += request.weight
        request.reserved_on = target
        self.clock.after(delay, self._land, request, target, prefill_tokens, have_tokens)

    def _land(
        self, request: SimRequest, target: Node, prefill_tokens: int, have_tokens: int
    ) -> None:
        target.reserved -= request.weight
        request.reserved_on = None
        if target.state in (NodeState.ACTIVE, NodeState.DRAINING):
            self._begin(request, target, prefill_tokens, have_tokens)
            return
        # The target was noticed or lost meanwhile: the request waits for another; what it
        # brought is in the store by now.
        load = (
            self.calibration.kv_megabytes((request.prompt_tokens + have_tokens) * request.weight)
            / self.calibration.store_read_mb_per_second
        )
        self._requeue(request, Pending(self.clock.now, load, prefill_tokens, have_tokens))
        self._pump()

    # -- the fleet -------------------------------------------------------------------------

    def _note(self, kind: str, node: Node) -> None:
        if self._log:
            self.counters.events_log.append((self.clock.now, kind, node.node_id))

    def _capacity(self, zone: str, capacity: int) -> None:
        for node in self.fleet.reclaim(zone, capacity):
            self._notice(node, self.config.grace_seconds)
        self._plan()

    def _scripted(self, action: ClusterAction) -> None:
        if action.kind == "join":
            node = self.fleet.launch(
                Market.SPOT, "a", self.clock.now, NodeState.BOOTING, action.node_id
            )
            self._note("join", node)
            self.clock.after(self.calibration.boot_seconds, self._ready, node, NodeState.STANDBY)
            return
        node = next(n for n in self.fleet.nodes if n.node_id == action.node_id)
        if action.kind == "notice":
            grace = action.grace_seconds
            self._notice(node, self.config.grace_seconds if grace is None else grace)
        else:
            self._kill(node)

    def _notice(self, node: Node, grace_seconds: float) -> None:
        if node.state in (NodeState.NOTICED, NodeState.GONE):
            return
        self.counters.notices += 1
        self._note("notice", node)
        self.fleet.leave_routing(node, NodeState.NOTICED)
        node.deadline = self.clock.now + grace_seconds
        self.clock.at(node.deadline, self._terminate, node)
        self._replace(node)
        if node.running:
            self.policy.on_notice(self, node)
        self._plan()
        self._pump()

    def _kill(self, node: Node) -> None:
        if node.state == NodeState.GONE:
            return
        self.counters.kills += 1
        self._note("kill", node)
        self.fleet.leave_routing(node, NodeState.NOTICED)
        self._replace(node)
        self._terminate(node)

    def _replace(self, node: Node) -> None:
        """Keeps the serving count: a standby (from another zone first) takes a lost node's
        place in routing."""
        if len(self.fleet.active) < self.config.fleet.nodes:
            self.fleet.promote(node.zone, node)

    def _terminate(self, node: Node) -> None:
        if node.state == NodeState.GONE:
            return
        lost = sorted(node.running, key=lambda r: r.arrival)
        for request in lost:
            self._detach(request)
        self._gone(node)
        for request in lost:
            self.policy.on_loss(self, request)
        self._pump()

    def _gone(self, node: Node) -> None:
        self.fleet.leave_routing(node, NodeState.GONE)
        node.gone_at = self.clock.now
        node.version += 1
        self._plan()

    def _ready(self, node: Node, as_state: NodeState | None = None) -> None:
        if node.state != NodeState.BOOTING:
            return  # noticed while booting: it never serves
        node.last_t = node.stall_until = self.clock.now
        serving = (
            node.market == Market.ON_DEMAND or len(self.fleet.active) < self.config.fleet.nodes
        )
        if as_state == NodeState.STANDBY or not serving:
            node.state = NodeState.STANDBY
        else:
            self.fleet.activate(node)
        self._note("ready", node)
        self._plan()
        self._pump()

    def _plan(self) -> None:
        self.fleet.plan(self._launch, self._retire, self._demand_nodes)

    def _launch(self, market: Market, zone: str) -> None:
        node = self.fleet.launch(market, zone, self.clock.now, NodeState.BOOTING)
        self._note("launch", node)
        self.clock.after(self.calibration.boot_seconds, self._ready, node)

    def _retire(self, node: Node) -> None:
        if node.state == NodeState.BOOTING:
            self.fleet.leave_routing(node, NodeState.GONE)
            node.gone_at = self.clock.now
            return
        self.fleet.leave_routing(node, NodeState.DRAINING)
        if len(self.fleet.active) < self.config.fleet.nodes:
            self.fleet.promote()
        if node.in_flight == 0:
            self._gone(node)

    # -- results ---------------------------------------------------------------------------

    def delivered_tokens(self, request: SimRequest) -> int:
        return self._delivered.get(request, 0)
