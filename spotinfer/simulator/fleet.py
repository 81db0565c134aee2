"""The fleet: its nodes, the spot capacity of each zone, and what it launches or retires.

The fleet wants ``nodes`` serving nodes and ``standbys`` warm standbys. It launches spot
nodes where a zone has capacity (spread: the zone with fewest of its nodes; else the first
zone only). With on-demand fallback it launches on-demand nodes only while spot nodes cannot
hold the load — the nodes the load needs (the simulation's autoscaler measures it), at most
``nodes`` — and retires them (drains: no new requests, the running ones finish) once ready
spot nodes hold it again.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from spotinfer.simulator.calibration import Calibration
from spotinfer.simulator.node import Market, Node, NodeState
from spotinfer.simulator.policies import Policy

LIVE = frozenset({NodeState.BOOTING, NodeState.STANDBY, NodeState.ACTIVE})
READY = frozenset({NodeState.STANDBY, NodeState.ACTIVE})


@dataclass(frozen=True)
class FleetSpec:
    nodes: int  # serving nodes wanted
    standbys: int = 0
    autoscale: bool = True  # False: only what a script does (a drill replay)

    def __post_init__(self) -> None:
        if self.nodes < 0 or self.standbys < 0:
            raise ValueError("nodes and standbys must not be negative")


class Fleet:
    def __init__(
        self,
        spec: FleetSpec,
        policy: Policy,
        calibration: Calibration,
        capacity: dict[str, int],
        rng: random.Random,
    ) -> None:
        self.spec = spec
        self.policy = policy
        self.calibration = calibration
        self.capacity = dict(capacity)
        self.nodes: list[Node] = []
        self.active: list[Node] = []  # routable, in the order they became active
        self._rng = rng
        self._count = 0

    # -- queries ---------------------------------------------------------------------------

    def held(self, zone: str) -> list[Node]:
        """Spot nodes that hold the zone's capacity (a noticed one is being taken back)."""
        return [
            n for n in self.nodes if n.zone == zone and n.market == Market.SPOT and n.state in LIVE
        ]

    def count(self, states: Iterable[NodeState], market: Market | None = None) -> int:
        wanted = frozenset(states)
        return sum(
            1 for n in self.nodes if n.state in wanted and (market is None or n.market == market)
        )

    def standbys(self) -> list[Node]:
        return [n for n in self.nodes if n.state == NodeState.STANDBY]

    # -- changes ---------------------------------------------------------------------------

    def launch(
        self, market: Market, zone: str, now: float, state: NodeState, node_id: str | None = None
    ) -> Node:
        name = node_id or f"node-{self._count}"
        node = Node(name, zone, market, self.calibration, now, state)
        self._count += 1
        self.nodes.append(node)
        if state == NodeState.ACTIVE:
            self.active.append(node)
        return node

    def activate(self, node: Node) -> None:
        node.state = NodeState.ACTIVE
        self.active.append(node)

    def leave_routing(self, node: Node, state: NodeState) -> None:
        if node in self.active:
            self.active.remove(node)
        node.state = state

    def promote(self, avoid_zone: str | None = None, exclude: Node | None = None) -> Node | None:
        """A ready standby made active, one outside ``avoid_zone`` first; None if none."""
        ready = [n for n in self.standbys() if n is not exclude]
        if not ready:
            return None
        ready.sort(key=lambda n: n.zone == avoid_zone)
        self.activate(ready[0])
        return ready[0]

    def reclaim(self, zone: str, capacity: int) -> list[Node]:
        """The zone now allows ``capacity`` spot nodes: the nodes the cloud takes back (picked
        at random among those the fleet holds there)."""
        self.capacity[zone] = capacity
        held = self.held(zone)
        excess = len(held) - capacity
        return self._rng.sample(held, excess) if excess > 0 else []

    def plan(
        self,
        launch: Callable[[Market, str], None],
        retire: Callable[[Node], None],
        demand_nodes: int | None = None,
    ) -> None:
        """Launches what the fleet lacks and retires on-demand nodes it no longer needs.
        ``demand_nodes``: the nodes the load needs now (None: all ``nodes``); on-demand
        fallback covers what spot cannot of min(nodes, demand_nodes)."""
        if not self.spec.autoscale:
            return
        wanted = self.spec.nodes + self.spec.standbys
        if self.policy.uses_spot:
            zones = sorted(self.capacity) if self.policy.spread else sorted(self.capacity)[:1]
            spot_live = self.count(LIVE, Market.SPOT)
            while spot_live < wanted:
                room = [z for z in zones if self.capacity[z] > len(self.held(z))]
                if not room:
                    break
                zone = min(room, key=lambda z: (len(self.held(z)), z))
                launch(Market.SPOT, zone)
                spot_live += 1
        if not self.policy.uses_spot:
            for _ in range(self.spec.nodes - self.count(LIVE, Market.ON_DEMAND)):
                launch(Market.ON_DEMAND, "on-demand")
            return
        if not self.policy.on_demand_fallback:
            return
        needed = self.spec.nodes if demand_nodes is None else min(self.spec.nodes, demand_nodes)
        od_live = self.count(LIVE, Market.ON_DEMAND)
        od_wanted = max(0, needed - self.count(LIVE, Market.SPOT))
        for _ in range(od_wanted - od_live):
            launch(Market.ON_DEMAND, "on-demand")
        # Retire only what ready spot nodes already replace (booting ones do not serve yet).
        surplus = min(od_live - od_wanted, od_live + self.count(READY, Market.SPOT) - needed)
        if surplus > 0:
            retiring = [n for n in self.nodes if n.market == Market.ON_DEMAND and n.state in LIVE]
            for node in sorted(retiring, key=lambda n: (n.state != NodeState.BOOTING, n.in_flight))[
                :surplus
            ]:
                retire(node)
