"""Builds, in moto, the AWS resources infra/terraform/aws creates for one fleet.

Only what the adapter touches: tagged launch template and Auto Scaling group with a mixed
instances policy, a tagged FIS experiment template, and the notice queue fed by an
EventBridge rule with the module's event pattern; on request, the on-demand fallback group.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import boto3

from spotinfer.fleet.constants import (
    AWS_EVENT_SOURCE,
    AWS_INTERRUPTION_DETAIL_TYPE,
    AWS_NOTICE_QUEUE_SUFFIX,
    AWS_REBALANCE_DETAIL_TYPE,
    FALLBACK_TIER,
    FLEET_TAG_KEY,
    ROLE_TAG_KEY,
    TIER_TAG_KEY,
    WORKER_ROLE,
)

REGION = "us-east-1"
# An AMI id moto ships in its catalogue.
MOTO_AMI_ID = "ami-12c6146b"


@dataclass
class AwsClients:
    ec2: Any
    autoscaling: Any
    fis: Any
    sqs: Any
    events: Any

    @classmethod
    def at(cls, endpoint_url: str) -> AwsClients:
        session = boto3.session.Session(region_name=REGION)
        return cls(
            *(
                session.client(service, endpoint_url=endpoint_url)
                for service in ("ec2", "autoscaling", "fis", "sqs", "events")
            )
        )


@dataclass
class MotoFleet:
    name: str
    group_name: str
    template_id: str
    queue_url: str


def _tags(
    fleet: str, group: str, role: str = WORKER_ROLE, extra: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    tags = {FLEET_TAG_KEY: fleet, ROLE_TAG_KEY: role, **(extra or {})}
    return [
        {
            "Key": key,
            "Value": value,
            "PropagateAtLaunch": True,
            "ResourceId": group,
            "ResourceType": "auto-scaling-group",
        }
        for key, value in tags.items()
    ]


def create_fleet(clients: AwsClients, name: str, desired: int = 2) -> MotoFleet:
    vpc_id = clients.ec2.create_vpc(CidrBlock="10.40.0.0/16")["Vpc"]["VpcId"]
    subnet_id = clients.ec2.create_subnet(
        VpcId=vpc_id, CidrBlock="10.40.1.0/24", AvailabilityZone=f"{REGION}a"
    )["Subnet"]["SubnetId"]
    template_id = clients.ec2.create_launch_template(
        LaunchTemplateName=f"{name}-worker",
        LaunchTemplateData={"ImageId": MOTO_AMI_ID, "MetadataOptions": {"HttpTokens": "required"}},
    )["LaunchTemplate"]["LaunchTemplateId"]
    group_name = f"{name}-workers-0001"
    clients.autoscaling.create_auto_scaling_group(
        AutoScalingGroupName=group_name,
        MinSize=1,
        MaxSize=6,
        DesiredCapacity=desired,
        VPCZoneIdentifier=subnet_id,
        CapacityRebalance=True,
        MixedInstancesPolicy={
            "LaunchTemplate": {
                "LaunchTemplateSpecification": {
                    "LaunchTemplateId": template_id,
                    "Version": "$Latest",
                },
                "Overrides": [{"InstanceType": "g6.xlarge"}, {"InstanceType": "g5.xlarge"}],
            },
            "InstancesDistribution": {
                "OnDemandBaseCapacity": 0,
                "OnDemandPercentageAboveBaseCapacity": 0,
                "SpotAllocationStrategy": "capacity-optimized",
            },
        },
        Tags=_tags(name, group_name),
    )
    fis_template_id = clients.fis.create_experiment_template(
        clientToken=f"{name}-template",
        description=f"interrupt one spot worker of {name}",
        roleArn="arn:aws:iam::123456789012:role/spotinfer-fis",
        stopConditions=[{"source": "none"}],
        targets={
            "spot-workers": {
                "resourceType": "aws:ec2:spot-instance",
                "resourceTags": {FLEET_TAG_KEY: name, ROLE_TAG_KEY: WORKER_ROLE},
                "selectionMode": "COUNT(1)",
            }
        },
        actions={
            "interrupt-spot-workers": {
                "actionId": "aws:ec2:send-spot-instance-interruptions",
                "parameters": {"durationBeforeInterruption": "PT2M"},
                "targets": {"SpotInstances": "spot-workers"},
            }
        },
        tags={FLEET_TAG_KEY: name},
    )["experimentTemplate"]["id"]
    queue_url = clients.sqs.create_queue(QueueName=f"{name}{AWS_NOTICE_QUEUE_SUFFIX}")["QueueUrl"]
    queue_arn = clients.sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])[
        "Attributes"
    ]["QueueArn"]
    rule = f"{name}-spot-notices"
    clients.events.put_rule(
        Name=rule,
        EventPattern=json.dumps(
            {
                "source": [AWS_EVENT_SOURCE],
                "detail-type": [AWS_INTERRUPTION_DETAIL_TYPE, AWS_REBALANCE_DETAIL_TYPE],
            }
        ),
    )
    clients.events.put_targets(Rule=rule, Targets=[{"Id": "queue", "Arn": queue_arn}])
    return MotoFleet(name, group_name, fis_template_id, queue_url)


def create_fallback_group(clients: AwsClients, fleet: MotoFleet, max_size: int) -> str:
    """The module's fallback group beside ``fleet``'s workers: on demand, empty, tier-tagged."""
    spot_group = clients.autoscaling.describe_auto_scaling_groups(
        AutoScalingGroupNames=[fleet.group_name]
    )["AutoScalingGroups"][0]
    group_name = f"{fleet.name}-fallback-0001"
    clients.autoscaling.create_auto_scaling_group(
        AutoScalingGroupName=group_name,
        MinSize=0,
        MaxSize=max_size,
        DesiredCapacity=0,
        VPCZoneIdentifier=spot_group["VPCZoneIdentifier"],
        MixedInstancesPolicy={
            "LaunchTemplate": {
                "LaunchTemplateSpecification": {
                    "LaunchTemplateName": f"{fleet.name}-worker",
                    "Version": "$Latest",
                },
                "Overrides": [{"InstanceType": "g6.xlarge"}, {"InstanceType": "g5.xlarge"}],
            },
            "InstancesDistribution": {
                "OnDemandBaseCapacity": 0,
                "OnDemandPercentageAboveBaseCapacity": 100,
            },
        },
        Tags=_tags(fleet.name, group_name, extra={TIER_TAG_KEY: FALLBACK_TIER}),
    )
    return group_name


def put_spot_event(clients: AwsClients, detail_type: str, detail: dict[str, Any]) -> None:
    """Publish an EC2 spot event on the default bus, as EC2 itself would."""
    response = clients.events.put_events(
        Entries=[
            {
                "Source": AWS_EVENT_SOURCE,
                "DetailType": detail_type,
                "Detail": json.dumps(detail),
            }
        ]
    )
    assert response["FailedEntryCount"] == 0


def group_instance_ids(clients: AwsClients, group_name: str) -> set[str]:
    groups = clients.autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[group_name])
    return {instance["InstanceId"] for instance in groups["AutoScalingGroups"][0]["Instances"]}
