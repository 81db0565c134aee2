"""The on-demand fallback group: its capacity, the bounds on it, and when to grow or release it.

The fallback is an optional second worker group of on-demand VMs (Terraform
``fallback_max_count``) that stays at 0 while spot capacity holds the load. Its workers
register without ``--spot``, and the coordinator routes to them only while spot workers fall
short. ``fallback_count_wanted`` is the policy: what to ask of the group, given the spot side;
``autoscale_fallback`` is one round of it against a fleet, ``autoscale_rounds`` a round every
so many seconds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spotinfer.fleet.errors import FleetError
from spotinfer.fleet.instance import FleetInstance, InstanceState

if TYPE_CHECKING:
    from spotinfer.fleet.adapter import Fleet


@dataclass(frozen=True)
class FallbackCapacity:
    group: str
    """Auto Scaling group / managed instance group name."""
    count: int
    """Fallback workers asked for (desired capacity / target size), not necessarily running."""
    max_count: int
    """The most the group may hold (Terraform ``fallback_max_count``)."""

    def as_row(self) -> dict[str, str]:
        return {"group": self.group, "count": str(self.count), "max_count": str(self.max_count)}


def check_fallback_count(count: int, max_count: int) -> None:
    """Raise FleetError unless ``0 <= count <= max_count``."""
    if count < 0:
        raise FleetError(f"fallback worker count must not be negative, got {count}")
    if count > max_count:
        raise FleetError(
            f"{count} fallback workers is above the fallback group's maximum of {max_count}; "
            "raise fallback_max_count in Terraform"
        )


def fallback_count_wanted(
    spot_wanted: int, spot_ready: int, fallback_count: int, fallback_max: int
) -> int:
    """The fallback group's size to ask for.

    While fewer spot workers serve than are wanted, the fallback grows to cover the shortfall,
    capped at ``fallback_max``. It does not shrink while spot is still short: releasing a
    fallback worker moves its requests, which should happen once, when spot is back. Once
    ``spot_ready`` reaches ``spot_wanted`` the answer is 0.
    """
    for name, value in (
        ("spot_wanted", spot_wanted),
        ("spot_ready", spot_ready),
        ("fallback_count", fallback_count),
        ("fallback_max", fallback_max),
    ):
        if value < 0:
            raise ValueError(f"{name} must not be negative, got {value}")
    shortfall = spot_wanted - spot_ready
    if shortfall <= 0:
        return 0
    return min(fallback_max, max(fallback_count, shortfall))


def spot_ready_count(workers: Iterable[FleetInstance]) -> int:
    """Running members of the spot workers' group.

    Counted by group, not by lifecycle: the spot group's desired capacity includes its
    on-demand base workers (AWS ``on_demand_base_count``), while fallback workers are no part
    of it. A noticed worker (STOPPING) or one still booting does not count.
    """
    return sum(
        1 for worker in workers if worker.state is InstanceState.RUNNING and not worker.is_fallback
    )


@dataclass(frozen=True)
class FallbackDecision:
    """One round of the policy: what it saw of the spot side, and the fallback before / after."""

    group: str
    spot_wanted: int
    spot_ready: int
    count_before: int
    count_after: int
    max_count: int

    @property
    def changed(self) -> bool:
        return self.count_after != self.count_before

    @property
    def reason(self) -> str:
        shortfall = self.spot_wanted - self.spot_ready
        if shortfall <= 0:
            return "spot holds the load"
        if self.count_after < shortfall:
            return f"spot short by {shortfall}, capped at the maximum of {self.max_count}"
        if self.count_after > shortfall:
            return f"spot short by {shortfall}; kept until spot is back"
        return f"spot short by {shortfall}"

    def as_row(self) -> dict[str, str]:
        return {
            "group": self.group,
            "spot_wanted": str(self.spot_wanted),
            "spot_ready": str(self.spot_ready),
            "fallback_before": str(self.count_before),
            "fallback_after": str(self.count_after),
            "max_count": str(self.max_count),
            "reason": self.reason,
        }

    def describe(self) -> str:
        spot = f"spot {self.spot_ready}/{self.spot_wanted} ready"
        if self.changed:
            fallback = f"fallback {self.group} {self.count_before} → {self.count_after}"
        else:
            fallback = f"fallback {self.group} stays at {self.count_before}"
        return f"{spot}: {fallback} ({self.reason})"


def autoscale_fallback(fleet: Fleet) -> FallbackDecision:
    """One round: read both groups, apply ``fallback_count_wanted``, and resize the fallback
    group only if the answer differs from its current size. Raises FleetError as the adapter
    does; nothing is changed if a read fails."""
    fallback = fleet.fallback_capacity()
    spot_wanted = fleet.capacity()
    spot_ready = spot_ready_count(fleet.list_workers())
    wanted = fallback_count_wanted(spot_wanted, spot_ready, fallback.count, fallback.max_count)
    if wanted != fallback.count:
        fleet.set_fallback_capacity(wanted)
    return FallbackDecision(
        group=fallback.group,
        spot_wanted=spot_wanted,
        spot_ready=spot_ready,
        count_before=fallback.count,
        count_after=wanted,
        max_count=fallback.max_count,
    )


def autoscale_rounds(
    fleet: Fleet, every_seconds: float, stop: threading.Event
) -> Iterator[FallbackDecision | FleetError]:
    """A round now and then every ``every_seconds`` until ``stop`` is set, yielding each
    round's decision, or its FleetError: a cloud call that fails ends the round, not the loop
    (the next round reads everything afresh)."""
    if every_seconds <= 0:
        raise ValueError(f"every_seconds must be positive, got {every_seconds}")
    while not stop.is_set():
        outcome: FallbackDecision | FleetError
        try:
            outcome = autoscale_fallback(fleet)
        except FleetError as error:
            outcome = error
        yield outcome
        if stop.wait(every_seconds):
            return
