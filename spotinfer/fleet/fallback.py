"""The on-demand fallback group: its capacity, the bounds on it, and when to grow or release it.

The fallback is an optional second worker group of on-demand VMs (Terraform
``fallback_max_count``) that stays at 0 while spot capacity holds the load. Its workers
register without ``--spot``, and the coordinator routes to them only while spot workers fall
short. ``fallback_count_wanted`` is the policy: what to ask of the group, given the spot side.
"""

from __future__ import annotations

from dataclasses import dataclass

from spotinfer.fleet.errors import FleetError


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
