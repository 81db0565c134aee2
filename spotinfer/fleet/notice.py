"""A termination notice about one VM of a fleet, as seen from outside the VM.

The daemon on a VM reads its own notice from the metadata service
(``context_daemon.notices``); the fleet adapters see every VM's notices through cloud events
(EventBridge on AWS). Both speak the same ``NoticeAction`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from context_daemon.notices.notice import NoticeAction


@dataclass(frozen=True)
class FleetNotice:
    cloud: str
    """Registry name of the fleet adapter that translated it (``aws``, ``gcp``)."""
    instance_id: str
    action: NoticeAction
    event_time_unix: float
    """When the cloud emitted the event."""
    deadline_unix: float | None
    """When the VM goes away, in unix seconds; None for a hint without a deadline."""
    region: str | None = None
    event_id: str | None = None
    raw: Any = field(default=None, compare=False)
    """The event as the cloud sent it, for logs."""

    def as_row(self) -> dict[str, Any]:
        """Plain values for JSON output (one line per notice)."""
        return {
            "cloud": self.cloud,
            "instance_id": self.instance_id,
            "action": self.action.value,
            "event_time_unix": self.event_time_unix,
            "deadline_unix": self.deadline_unix,
            "region": self.region,
            "event_id": self.event_id,
        }
