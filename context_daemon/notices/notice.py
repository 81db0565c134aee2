"""What every notice watcher reports: the cloud is about to take this VM away (or hints so)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class NoticeAction(enum.Enum):
    TERMINATE = "terminate"  # the VM will be deleted
    STOP = "stop"  # stopped or hibernated: memory is lost all the same
    PREEMPT = "preempt"  # GCP / Azure wording for a spot eviction
    REBALANCE = "rebalance"  # AWS hint: elevated risk, no deadline yet

    @property
    def ends_vm(self) -> bool:
        """True when the VM will go away (a rebalance hint only says it may)."""
        return self is not NoticeAction.REBALANCE


@dataclass(frozen=True)
class Notice:
    source: str
    """Registry name of the watcher that saw it (``aws``, ``gcp``, ``azure``, ``file``)."""
    action: NoticeAction
    deadline_unix: float | None
    """When the VM goes away, in unix seconds; None for a hint without a deadline."""
    received_unix: float = field(compare=False)
    """When this daemon first saw the notice (its clock). Not part of equality: the same
    notice seen on two polls is one notice."""
    raw: Any = field(default=None, compare=False)
    """The notice as the cloud sent it (parsed JSON or text), for logs."""
    event_id: str | None = None
    """The cloud's id of the event where it has one (Azure), e.g. for early approval."""

    def seconds_left(self, now_unix: float) -> float | None:
        if self.deadline_unix is None:
            return None
        return max(0.0, self.deadline_unix - now_unix)
