"""The AWS fleet adapter: EC2 Auto Scaling, FIS drills and EventBridge spot notices (boto3).

What it expects is what infra/terraform/aws creates: worker instances tagged
``spotinfer:fleet=NAME`` and ``spotinfer:role=worker`` in one Auto Scaling group carrying the
same tags, optionally a second, on-demand one that also carries ``spotinfer:tier=fallback``,
an FIS experiment template tagged with the fleet, and an SQS queue ``NAME-spot-notices`` fed
by EventBridge.

The queue's EventBridge events are translated by ``spotinfer.fleet.aws_events``.

boto3 is imported by ``connect`` only, so importing this module stays cheap.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from spotinfer.fleet.adapter import Fleet
from spotinfer.fleet.aws_events import notice_from_event
from spotinfer.fleet.config import AwsFleetConfig
from spotinfer.fleet.constants import (
    AWS_LISTED_STATES,
    AWS_NOTICE_QUEUE_SUFFIX,
    FALLBACK_TIER,
    FLEET_TAG_KEY,
    ROLE_TAG_KEY,
    SQS_MAX_MESSAGES,
    SQS_MAX_WAIT_SECONDS,
    TIER_TAG_KEY,
    WORKER_ROLE,
)
from spotinfer.fleet.drill import DrillRun, DrillState
from spotinfer.fleet.errors import FleetError, FleetEventError
from spotinfer.fleet.fallback import FallbackCapacity, check_fallback_count
from spotinfer.fleet.instance import FleetInstance, InstanceState, Lifecycle
from spotinfer.fleet.notice import FleetNotice

logger = logging.getLogger(__name__)

T = TypeVar("T")

_EC2_STATES = {
    "pending": InstanceState.PROVISIONING,
    "running": InstanceState.RUNNING,
    "shutting-down": InstanceState.STOPPING,
    "stopping": InstanceState.STOPPING,
    "stopped": InstanceState.STOPPED,
    "terminated": InstanceState.TERMINATED,
}

_FIS_STATES = {
    "pending": DrillState.PENDING,
    "initiating": DrillState.PENDING,
    "running": DrillState.RUNNING,
    "completed": DrillState.COMPLETED,
    "stopping": DrillState.STOPPED,
    "stopped": DrillState.STOPPED,
    "cancelled": DrillState.STOPPED,
    "failed": DrillState.FAILED,
}


def _call(what: str, request: Callable[[], T]) -> T:
    """Run one AWS request; the client library's errors become FleetError."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return request()
    except ClientError as error:
        details = error.response.get("Error", {})
        raise FleetError(f"{what}: {details.get('Code')}: {details.get('Message')}") from error
    except BotoCoreError as error:
        raise FleetError(f"{what}: {error}") from error


def _instance_from_ec2(description: Mapping[str, Any]) -> FleetInstance:
    is_spot = description.get("InstanceLifecycle") == "spot"
    # The fallback group propagates its tier tag to the instances it launches.
    is_fallback = _is_fallback(description)
    return FleetInstance(
        instance_id=description["InstanceId"],
        zone=description.get("Placement", {}).get("AvailabilityZone", ""),
        state=_EC2_STATES.get(description["State"]["Name"], InstanceState.TERMINATED),
        lifecycle=Lifecycle.SPOT if is_spot else Lifecycle.ON_DEMAND,
        machine_type=description.get("InstanceType", ""),
        private_ip=description.get("PrivateIpAddress"),
        is_fallback=is_fallback,
    )


def _is_fallback(resource: Mapping[str, Any]) -> bool:
    """An Auto Scaling group or EC2 instance tagged as the fallback tier."""
    return any(
        tag.get("Key") == TIER_TAG_KEY and tag.get("Value") == FALLBACK_TIER
        for tag in resource.get("Tags", [])
    )


def _drill_from_experiment(experiment: Mapping[str, Any], targets: tuple[str, ...]) -> DrillRun:
    state = experiment.get("state", {})
    return DrillRun(
        cloud="aws",
        drill_id=experiment["id"],
        state=_FIS_STATES.get(state.get("status", ""), DrillState.FAILED),
        targets=targets,
        detail=state.get("reason", ""),
    )


class AwsFleet(Fleet, cloud="aws"):
    """A spotinfer fleet on EC2; clients are boto3 clients of ec2, autoscaling, fis and sqs."""

    config_class = AwsFleetConfig

    def __init__(
        self, config: AwsFleetConfig, *, ec2: Any, autoscaling: Any, fis: Any, sqs: Any
    ) -> None:
        self.config = config
        self._ec2 = ec2
        self._autoscaling = autoscaling
        self._fis = fis
        self._sqs = sqs

    @classmethod
    def connect(cls, config: AwsFleetConfig) -> AwsFleet:
        import boto3

        session = boto3.session.Session(region_name=config.region)

        def client(service: str) -> Any:
            return session.client(service, endpoint_url=config.endpoint_url)

        return cls(
            config,
            ec2=client("ec2"),
            autoscaling=client("autoscaling"),
            fis=client("fis"),
            sqs=client("sqs"),
        )

    # ---- workers -------------------------------------------------------------------------

    def _fleet_filters(self) -> list[dict[str, Any]]:
        return [
            {"Name": f"tag:{FLEET_TAG_KEY}", "Values": [self.config.fleet_name]},
            {"Name": f"tag:{ROLE_TAG_KEY}", "Values": [WORKER_ROLE]},
        ]

    def _describe(self, filters: list[dict[str, Any]]) -> list[FleetInstance]:
        paginator = self._ec2.get_paginator("describe_instances")
        pages = _call("describe instances", lambda: list(paginator.paginate(Filters=filters)))
        workers = [
            _instance_from_ec2(description)
            for page in pages
            for reservation in page["Reservations"]
            for description in reservation["Instances"]
        ]
        return sorted(workers, key=lambda worker: worker.instance_id)

    def list_workers(self) -> list[FleetInstance]:
        states = {"Name": "instance-state-name", "Values": list(AWS_LISTED_STATES)}
        return self._describe([*self._fleet_filters(), states])

    def _describe_groups(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        paginator = self._autoscaling.get_paginator("describe_auto_scaling_groups")
        pages = _call("describe Auto Scaling groups", lambda: list(paginator.paginate(**request)))
        return [group for page in pages for group in page["AutoScalingGroups"]]

    def _group(self) -> dict[str, Any]:
        if self.config.group_name:
            groups = self._describe_groups({"AutoScalingGroupNames": [self.config.group_name]})
        else:
            # The fallback group carries the same fleet and role tags.
            groups = [
                group
                for group in self._describe_groups({"Filters": self._fleet_filters()})
                if not _is_fallback(group)
            ]
        if len(groups) != 1:
            wanted = self.config.group_name or f"tagged {FLEET_TAG_KEY}={self.config.fleet_name}"
            raise FleetError(
                f"expected one worker Auto Scaling group {wanted}, found {len(groups)}"
            )
        group: dict[str, Any] = groups[0]
        return group

    def capacity(self) -> int:
        desired: int = self._group()["DesiredCapacity"]
        return desired

    def set_capacity(self, worker_count: int) -> None:
        group = self._group()
        if not group["MinSize"] <= worker_count <= group["MaxSize"]:
            raise FleetError(
                f"{worker_count} workers is outside the group's {group['MinSize']}-"
                f"{group['MaxSize']}; change worker_min_count / worker_max_count in Terraform"
            )
        _call(
            "set desired capacity",
            lambda: self._autoscaling.set_desired_capacity(
                AutoScalingGroupName=group["AutoScalingGroupName"],
                DesiredCapacity=worker_count,
                HonorCooldown=False,
            ),
        )

    def _fallback_group(self) -> dict[str, Any]:
        name = self.config.fallback_group_name
        if name:
            groups = self._describe_groups({"AutoScalingGroupNames": [name]})
            wanted = f"named {name}"
        else:
            tier = {"Name": f"tag:{TIER_TAG_KEY}", "Values": [FALLBACK_TIER]}
            groups = self._describe_groups({"Filters": [*self._fleet_filters(), tier]})
            wanted = f"tagged {TIER_TAG_KEY}={FALLBACK_TIER}"
        if not groups:
            raise FleetError(
                f"fleet {self.config.fleet_name} has no on-demand fallback group {wanted}; "
                "set fallback_max_count above 0 in Terraform to create one"
            )
        if len(groups) > 1:
            raise FleetError(
                f"expected one fallback Auto Scaling group {wanted}, found {len(groups)}; "
                "pass --fallback-group-name"
            )
        return groups[0]

    def fallback_capacity(self) -> FallbackCapacity:
        group = self._fallback_group()
        return FallbackCapacity(
            group=group["AutoScalingGroupName"],
            count=group["DesiredCapacity"],
            max_count=group["MaxSize"],
        )

    def set_fallback_capacity(self, worker_count: int) -> None:
        group = self._fallback_group()
        check_fallback_count(worker_count, group["MaxSize"])
        _call(
            "set the fallback group's desired capacity",
            lambda: self._autoscaling.set_desired_capacity(
                AutoScalingGroupName=group["AutoScalingGroupName"],
                DesiredCapacity=worker_count,
                HonorCooldown=False,
            ),
        )

    def _terminate_keeping_capacity(self, instance_id: str) -> None:
        # The group launches the replacement at once because its desired capacity is kept.
        _call(
            f"replace {instance_id}",
            lambda: self._autoscaling.terminate_instance_in_auto_scaling_group(
                InstanceId=instance_id, ShouldDecrementDesiredCapacity=False
            ),
        )

    def replace(self, instance_ids: Sequence[str]) -> list[str]:
        self._check_members(instance_ids)
        members = {instance["InstanceId"] for instance in self._group()["Instances"]}
        outside = sorted(set(instance_ids) - members)
        if outside:
            raise FleetError(f"not in the workers' Auto Scaling group: {', '.join(outside)}")
        for instance_id in instance_ids:
            self._terminate_keeping_capacity(instance_id)
        return list(instance_ids)

    def replace_lost(self) -> list[str]:
        group = self._group()
        unhealthy = {
            instance["InstanceId"]
            for instance in group["Instances"]
            if instance.get("HealthStatus") == "Unhealthy"
        }
        members = {instance["InstanceId"] for instance in group["Instances"]}
        # Terminated members are left to the group, which replaces them on its own.
        lost = sorted(
            worker.instance_id
            for worker in self.list_workers()
            if worker.instance_id in members
            and (worker.state is InstanceState.STOPPED or worker.instance_id in unhealthy)
        )
        for instance_id in lost:
            self._terminate_keeping_capacity(instance_id)
        return lost

    # ---- drills --------------------------------------------------------------------------

    def find_drill_template(self) -> str:
        """Id of the FIS experiment template tagged with this fleet."""
        paginator = self._fis.get_paginator("list_experiment_templates")
        pages = _call("list FIS experiment templates", lambda: list(paginator.paginate()))
        matches = [
            template["id"]
            for page in pages
            for template in page.get("experimentTemplates", [])
            if template.get("tags", {}).get(FLEET_TAG_KEY) == self.config.fleet_name
        ]
        if len(matches) != 1:
            raise FleetError(
                f"expected one FIS experiment template tagged {FLEET_TAG_KEY}="
                f"{self.config.fleet_name}, found {len(matches)}; pass --target TEMPLATE_ID"
            )
        return matches[0]

    def start_drill(self, target: str | None = None) -> DrillRun:
        template_id = target or self.find_drill_template()
        response = _call(
            "start FIS experiment",
            lambda: self._fis.start_experiment(
                clientToken=str(uuid.uuid4()),
                experimentTemplateId=template_id,
                tags={FLEET_TAG_KEY: self.config.fleet_name},
            ),
        )
        return _drill_from_experiment(response["experiment"], ())

    def drill_status(self, drill_id: str) -> DrillRun:
        response = _call(
            f"get FIS experiment {drill_id}", lambda: self._fis.get_experiment(id=drill_id)
        )
        resolved = _call(
            f"list targets of FIS experiment {drill_id}",
            lambda: self._fis.list_experiment_resolved_targets(experimentId=drill_id),
        )
        targets = tuple(
            sorted(
                target["resourceArn"].rsplit("/", 1)[-1]
                for target in resolved.get("resolvedTargets", [])
            )
        )
        return _drill_from_experiment(response["experiment"], targets)

    # ---- notices -------------------------------------------------------------------------

    def notice_queue_url(self) -> str:
        queue_name = f"{self.config.fleet_name}{AWS_NOTICE_QUEUE_SUFFIX}"
        response = _call(
            f"find queue {queue_name}", lambda: self._sqs.get_queue_url(QueueName=queue_name)
        )
        url: str = response["QueueUrl"]
        return url

    def _members(self, instance_ids: set[str]) -> set[str]:
        # Filter rather than InstanceIds=: unknown ids are then skipped, not an error, and
        # instances already terminated by their interruption still count.
        id_filter = {"Name": "instance-id", "Values": sorted(instance_ids)}
        return {
            worker.instance_id for worker in self._describe([*self._fleet_filters(), id_filter])
        }

    def receive_notices(
        self, queue_url: str | None = None, wait_seconds: int = SQS_MAX_WAIT_SECONDS
    ) -> list[FleetNotice]:
        """Notices about this fleet's workers waiting in the queue, oldest first.

        Long-polls up to ``wait_seconds``. Every message read is deleted, including events
        about other instances of the region (the EventBridge rule cannot filter by tag) and
        messages that are not spot events at all, which are logged.
        """
        if not 0 <= wait_seconds <= SQS_MAX_WAIT_SECONDS:
            raise FleetError(f"wait_seconds must be 0-{SQS_MAX_WAIT_SECONDS}, got {wait_seconds}")
        url = queue_url or self.notice_queue_url()
        response = _call(
            "receive notices",
            lambda: self._sqs.receive_message(
                QueueUrl=url, MaxNumberOfMessages=SQS_MAX_MESSAGES, WaitTimeSeconds=wait_seconds
            ),
        )
        messages = response.get("Messages", [])
        notices: list[FleetNotice] = []
        for message in messages:
            try:
                notices.append(notice_from_event(json.loads(message["Body"])))
            except (json.JSONDecodeError, FleetEventError) as error:
                logger.warning("skipping a message that is no spot notice: %s", error)
        members = self._members({notice.instance_id for notice in notices}) if notices else set()
        if messages:
            entries = [
                {"Id": str(index), "ReceiptHandle": message["ReceiptHandle"]}
                for index, message in enumerate(messages)
            ]
            deleted = _call(
                "delete notices",
                lambda: self._sqs.delete_message_batch(QueueUrl=url, Entries=entries),
            )
            for failure in deleted.get("Failed", []):
                # Not fatal: SQS delivers it again after the visibility timeout.
                logger.warning("could not delete notice message: %s", failure.get("Message"))
        ours = [notice for notice in notices if notice.instance_id in members]
        return sorted(ours, key=lambda notice: notice.event_time_unix)
