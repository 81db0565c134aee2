"""One VM of a fleet as the adapters report it, whatever the cloud."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class InstanceState(enum.Enum):
    PROVISIONING = "provisioning"  # created, not yet booted (EC2 pending, GCE STAGING)
    RUNNING = "running"
    STOPPING = "stopping"  # on its way out: stopping, shutting down, suspending
    STOPPED = "stopped"  # still a member of the group but serving nothing
    TERMINATED = "terminated"  # gone; may linger in listings for a while

    @property
    def is_lost(self) -> bool:
        """True for a member that holds a place in the group but will not serve again by itself.

        STOPPING is not lost yet: the notice's grace period is still running and the daemon
        is moving its requests; replacing it now would cut that short.
        """
        return self in (InstanceState.STOPPED, InstanceState.TERMINATED)


class Lifecycle(enum.Enum):
    SPOT = "spot"
    ON_DEMAND = "on-demand"


@dataclass(frozen=True)
class FleetInstance:
    instance_id: str
    """EC2 instance id, or GCE instance name: the worker id the boot scripts give the worker."""
    zone: str
    state: InstanceState
    lifecycle: Lifecycle
    machine_type: str
    private_ip: str | None = None
    is_fallback: bool = False
    """A member of the on-demand fallback group (tier tag / label), not of the spot workers'
    group. Not the same as ``lifecycle``: the spot group may hold on-demand base workers."""

    def as_row(self) -> dict[str, str]:
        """Plain strings for tables and JSON output."""
        return {
            "instance_id": self.instance_id,
            "zone": self.zone,
            "state": self.state.value,
            "lifecycle": self.lifecycle.value,
            "machine_type": self.machine_type,
            "private_ip": self.private_ip or "",
            "group": "fallback" if self.is_fallback else "spot",
        }
