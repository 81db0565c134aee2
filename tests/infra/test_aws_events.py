"""EventBridge spot events -> FleetNotice: the shapes EC2 sends, and what is refused."""

from __future__ import annotations

import copy
from datetime import datetime, timezone
from typing import Any

import pytest

from context_daemon.notices.notice import NoticeAction
from spotinfer.fleet import FleetEventError, notice_from_event

INTERRUPTION: dict[str, Any] = {
    "version": "0",
    "id": "1e5527d7-bb36-4607-3370-4164db56a40e",
    "detail-type": "EC2 Spot Instance Interruption Warning",
    "source": "aws.ec2",
    "account": "123456789012",
    "time": "2026-11-30T12:00:00Z",
    "region": "us-east-1",
    "resources": ["arn:aws:ec2:us-east-1a:instance/i-0b662ef9931388ba0"],
    "detail": {"instance-id": "i-0b662ef9931388ba0", "instance-action": "terminate"},
}

REBALANCE: dict[str, Any] = {
    "version": "0",
    "id": "5e2e5c73-6c3e-4f62-9a4a-1b1b4d3b2f10",
    "detail-type": "EC2 Instance Rebalance Recommendation",
    "source": "aws.ec2",
    "account": "123456789012",
    "time": "2026-11-30T11:55:30Z",
    "region": "us-east-1",
    "resources": ["arn:aws:ec2:us-east-1:123456789012:instance/i-0b662ef9931388ba0"],
    "detail": {"instance-id": "i-0b662ef9931388ba0"},
}

NOON_UNIX = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc).timestamp()


def test_interruption_warning_gives_a_two_minute_deadline() -> None:
    notice = notice_from_event(INTERRUPTION)

    assert notice.cloud == "aws"
    assert notice.instance_id == "i-0b662ef9931388ba0"
    assert notice.action is NoticeAction.TERMINATE
    assert notice.event_time_unix == NOON_UNIX
    assert notice.deadline_unix == NOON_UNIX + 120
    assert notice.region == "us-east-1"
    assert notice.event_id == INTERRUPTION["id"]


@pytest.mark.parametrize(
    ("instance_action", "expected"),
    [("stop", NoticeAction.STOP), ("hibernate", NoticeAction.STOP)],
)
def test_stop_and_hibernate_end_the_vm_too(instance_action: str, expected: NoticeAction) -> None:
    event = copy.deepcopy(INTERRUPTION)
    event["detail"]["instance-action"] = instance_action

    notice = notice_from_event(event)

    assert notice.action is expected and notice.action.ends_vm


def test_rebalance_recommendation_is_a_hint_without_deadline() -> None:
    notice = notice_from_event(REBALANCE)

    assert notice.action is NoticeAction.REBALANCE
    assert notice.deadline_unix is None
    assert not notice.action.ends_vm


def _broken(change: str) -> Any:
    event = copy.deepcopy(INTERRUPTION)
    if change == "source":
        event["source"] = "aws.autoscaling"
    elif change == "detail-type":
        event["detail-type"] = "EC2 Instance State-change Notification"
    elif change == "instance-id":
        del event["detail"]["instance-id"]
    elif change == "instance-action":
        event["detail"]["instance-action"] = "reboot"
    elif change == "time":
        event["time"] = "yesterday"
    elif change == "detail":
        event["detail"] = "i-0b662ef9931388ba0"
    elif change == "not-an-object":
        return ["not", "an", "event"]
    return event


@pytest.mark.parametrize(
    "change",
    ["source", "detail-type", "instance-id", "instance-action", "time", "detail", "not-an-object"],
)
def test_anything_else_is_refused(change: str) -> None:
    with pytest.raises(FleetEventError):
        notice_from_event(_broken(change))
