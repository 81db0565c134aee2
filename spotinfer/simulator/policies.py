"""The fleet policies compared, registered by name. A policy says what the fleet does with
spot capacity and what happens to a request when its node is noticed or lost; the mechanics
(staging, flushes, loads, restarts) are the simulation's, calibrated.

| policy      | nodes                      | on a notice                | on a loss           |
|-------------|----------------------------|----------------------------|---------------------|
| spotinfer   | spot, spread, od fallback  | migrate (staged), 0 recompute | recover from store |
| reroute     | spot, spread               | restart from the prompt    | restart             |
| on-demand   | on-demand only             | (never noticed)            | (never lost)        |
| skyserve    | spot, spread, od fallback  | restart from the prompt    | restart             |

``reroute`` is what this coordinator's ``--failover-policy reroute`` does (a restart decodes
the delivered tokens again; the relay drops them); ``skyserve`` is SkyServe's recipe as its
paper describes it (zone spreading and on-demand fallback, client retries) without migration.
Each pair differs in one thing: reroute → skyserve adds the fallback, skyserve → spotinfer
adds migration and recovery from the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from spotinfer.simulator.arrivals import SimRequest
    from spotinfer.simulator.node import Node
    from spotinfer.simulator.simulation import Simulation


class Policy:
    _by_name: ClassVar[dict[str, type[Policy]]] = {}
    name: ClassVar[str]
    uses_spot: ClassVar[bool] = True
    spread: ClassVar[bool] = True  # nodes and standbys over every zone (else the first only)
    on_demand_fallback: ClassVar[bool] = False  # on-demand nodes while spot cannot hold N
    description: ClassVar[str] = ""

    def __init_subclass__(cls, name: str, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if name in Policy._by_name:
            raise ValueError(f"policy {name!r} is already registered")
        cls.name = name
        Policy._by_name[name] = cls

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(cls._by_name)

    @classmethod
    def create(cls, name: str) -> Policy:
        try:
            return cls._by_name[name]()
        except KeyError:
            raise ValueError(f"unknown policy {name!r}; known: {', '.join(cls.names())}") from None

    def on_notice(self, sim: Simulation, node: Node) -> None:
        """``node`` was noticed (already out of routing): move its requests, or not."""
        raise NotImplementedError

    def on_loss(self, sim: Simulation, request: SimRequest) -> None:
        """``request``'s node is gone with it still there (taken out of the node already)."""
        raise NotImplementedError


class SpotinferPolicy(Policy, name="spotinfer"):
    on_demand_fallback = True
    description = "migration with staging; recovery from the store; spread; on-demand fallback"

    def on_notice(self, sim: Simulation, node: Node) -> None:
        sim.migrate_all(node)

    def on_loss(self, sim: Simulation, request: SimRequest) -> None:
        sim.recover(request)


class ReroutePolicy(Policy, name="reroute"):
    description = "restart from the prompt elsewhere; spread; no fallback"

    def on_notice(self, sim: Simulation, node: Node) -> None:
        for request in sorted(node.running, key=lambda r: r.arrival):
            sim.restart(request)

    def on_loss(self, sim: Simulation, request: SimRequest) -> None:
        sim.restart(request)


class OnDemandPolicy(Policy, name="on-demand"):
    uses_spot = False
    description = "on-demand nodes only"

    def on_notice(self, sim: Simulation, node: Node) -> None:
        raise AssertionError("an on-demand node is never noticed")

    def on_loss(self, sim: Simulation, request: SimRequest) -> None:
        sim.restart(request)


class SkyServePolicy(ReroutePolicy, name="skyserve"):
    on_demand_fallback = True
    description = "spread over zones and on-demand fallback; restart on a notice (no migration)"
