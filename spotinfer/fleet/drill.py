"""A cloud preemption drill: an FIS experiment (AWS) or a simulated maintenance event (GCP)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DrillState(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    STOPPED = "stopped"  # cut short: by hand or by a stop condition (AWS alarm)
    FAILED = "failed"

    @property
    def is_final(self) -> bool:
        return self in (DrillState.COMPLETED, DrillState.STOPPED, DrillState.FAILED)


@dataclass(frozen=True)
class DrillRun:
    cloud: str
    drill_id: str
    """What ``drill_status`` takes: FIS experiment id, or ``ZONE/OPERATION`` on GCP."""
    state: DrillState
    targets: tuple[str, ...] = ()
    """Instances the drill acts on, where the cloud says so up front."""
    detail: str = ""
    """The cloud's own words about the state (reason, error message)."""

    def as_row(self) -> dict[str, str]:
        return {
            "cloud": self.cloud,
            "drill_id": self.drill_id,
            "state": self.state.value,
            "targets": ",".join(self.targets),
            "detail": self.detail,
        }
