"""EC2 spot events from EventBridge, translated into FleetNotices.

The notice queue (infra/terraform/aws/notices.tf) receives EventBridge envelopes; ``detail``
depends on the type::

    {"source": "aws.ec2", "detail-type": "EC2 Spot Instance Interruption Warning",
     "time": "2026-11-30T12:00:00Z", "region": "us-east-1", "id": "…",
     "detail": {"instance-id": "i-0abc…", "instance-action": "terminate"}}

    {"source": "aws.ec2", "detail-type": "EC2 Instance Rebalance Recommendation", …,
     "detail": {"instance-id": "i-0abc…"}}
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from context_daemon.notices.notice import NoticeAction
from spotinfer.fleet.constants import (
    AWS_EVENT_SOURCE,
    AWS_INTERRUPTION_DETAIL_TYPE,
    AWS_INTERRUPTION_NOTICE_SECONDS,
    AWS_REBALANCE_DETAIL_TYPE,
)
from spotinfer.fleet.errors import FleetEventError
from spotinfer.fleet.notice import FleetNotice

_INTERRUPTION_ACTIONS = {
    "terminate": NoticeAction.TERMINATE,
    "stop": NoticeAction.STOP,
    "hibernate": NoticeAction.STOP,  # memory is lost all the same
}


def _parse_event_time(text: Any) -> float:
    if not isinstance(text, str):
        raise FleetEventError(f"event time must be a string, got {text!r}")
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise FleetEventError(f"event time is not ISO 8601: {text!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def notice_from_event(event: Any) -> FleetNotice:
    """Translate one EventBridge spot event into a FleetNotice.

    An interruption warning ends the VM two minutes after the event; a rebalance
    recommendation is a hint without a deadline. Raises FleetEventError for anything else.
    """
    if not isinstance(event, Mapping):
        raise FleetEventError(f"an EventBridge event is a JSON object, got {type(event).__name__}")
    if event.get("source") != AWS_EVENT_SOURCE:
        raise FleetEventError(f"not an EC2 event: source {event.get('source')!r}")
    detail = event.get("detail")
    if not isinstance(detail, Mapping):
        raise FleetEventError("event has no detail object")
    instance_id = detail.get("instance-id")
    if not isinstance(instance_id, str) or not instance_id.startswith("i-"):
        raise FleetEventError(f"event names no instance: {instance_id!r}")
    event_time_unix = _parse_event_time(event.get("time"))

    detail_type = event.get("detail-type")
    deadline_unix: float | None
    if detail_type == AWS_INTERRUPTION_DETAIL_TYPE:
        instance_action = detail.get("instance-action")
        if instance_action not in _INTERRUPTION_ACTIONS:
            raise FleetEventError(f"unknown instance-action {instance_action!r}")
        action = _INTERRUPTION_ACTIONS[instance_action]
        deadline_unix = event_time_unix + AWS_INTERRUPTION_NOTICE_SECONDS
    elif detail_type == AWS_REBALANCE_DETAIL_TYPE:
        action = NoticeAction.REBALANCE
        deadline_unix = None
    else:
        raise FleetEventError(f"not a spot notice: detail-type {detail_type!r}")

    return FleetNotice(
        cloud="aws",
        instance_id=instance_id,
        action=action,
        event_time_unix=event_time_unix,
        deadline_unix=deadline_unix,
        region=event.get("region"),
        event_id=event.get("id"),
        raw=event,
    )
