"""The AWS adapter end to end: real boto3 calls to a moto server (server mode, loopback)."""

from __future__ import annotations

import json

import pytest

from context_daemon.notices.notice import NoticeAction
from spotinfer.fleet import AwsFleet, AwsFleetConfig, FleetError, InstanceState
from spotinfer.fleet.constants import AWS_INTERRUPTION_DETAIL_TYPE, AWS_REBALANCE_DETAIL_TYPE
from spotinfer.fleet.drill import DrillState
from spotinfer.fleet.fallback import autoscale_fallback

pytest.importorskip("boto3", reason="boto3 is not installed")
pytest.importorskip("moto.server", reason="moto[server] is not installed")

from tests.infra.aws_fleet_setup import (
    REGION,
    AwsClients,
    MotoFleet,
    create_fallback_group,
    create_fleet,
    group_instance_ids,
    put_spot_event,
)


@pytest.fixture
def clients(aws_endpoint: str) -> AwsClients:
    return AwsClients.at(aws_endpoint)


@pytest.fixture
def fleet(clients: AwsClients) -> MotoFleet:
    create_fleet(clients, "other", desired=1)  # a neighbour the adapter must not touch
    return create_fleet(clients, "demo", desired=2)


def _connect(endpoint: str, name: str = "demo", group_name: str | None = None) -> AwsFleet:
    config = AwsFleetConfig(
        fleet_name=name, region=REGION, group_name=group_name, endpoint_url=endpoint
    )
    return AwsFleet.connect(config)


def test_list_workers_finds_only_the_fleets_tagged_instances(
    aws_endpoint: str, clients: AwsClients, fleet: MotoFleet
) -> None:
    workers = _connect(aws_endpoint).list_workers()

    assert {worker.instance_id for worker in workers} == group_instance_ids(
        clients, fleet.group_name
    )
    assert len(workers) == 2
    assert all(worker.state is InstanceState.RUNNING for worker in workers)
    assert all(worker.zone == f"{REGION}a" for worker in workers)


def test_set_capacity_finds_the_group_by_tag_and_sets_desired(
    aws_endpoint: str, clients: AwsClients, fleet: MotoFleet
) -> None:
    _connect(aws_endpoint).set_capacity(4)

    group = clients.autoscaling.describe_auto_scaling_groups(
        AutoScalingGroupNames=[fleet.group_name]
    )["AutoScalingGroups"][0]
    assert group["DesiredCapacity"] == 4
    assert len(group_instance_ids(clients, fleet.group_name)) == 4
    other = clients.autoscaling.describe_auto_scaling_groups(
        AutoScalingGroupNames=["other-workers-0001"]
    )["AutoScalingGroups"][0]
    assert other["DesiredCapacity"] == 1


def test_set_capacity_outside_the_groups_bounds_is_refused(
    aws_endpoint: str, fleet: MotoFleet
) -> None:
    with pytest.raises(FleetError, match="outside the group's 1-6"):
        _connect(aws_endpoint).set_capacity(7)


def test_replace_swaps_an_instance_and_keeps_capacity(
    aws_endpoint: str, clients: AwsClients, fleet: MotoFleet
) -> None:
    before = group_instance_ids(clients, fleet.group_name)
    victim = sorted(before)[0]

    assert _connect(aws_endpoint).replace([victim]) == [victim]

    after = group_instance_ids(clients, fleet.group_name)
    assert victim not in after
    assert len(after) == 2


def test_replace_refuses_an_instance_of_another_fleet(
    aws_endpoint: str, clients: AwsClients, fleet: MotoFleet
) -> None:
    stranger = sorted(group_instance_ids(clients, "other-workers-0001"))[0]
    before = group_instance_ids(clients, fleet.group_name)

    with pytest.raises(FleetError, match=stranger):
        _connect(aws_endpoint).replace([stranger])

    assert group_instance_ids(clients, fleet.group_name) == before


def test_replace_lost_replaces_a_stopped_worker(
    aws_endpoint: str, clients: AwsClients, fleet: MotoFleet
) -> None:
    stopped = sorted(group_instance_ids(clients, fleet.group_name))[0]
    clients.ec2.stop_instances(InstanceIds=[stopped])
    adapter = _connect(aws_endpoint, group_name=fleet.group_name)

    assert adapter.replace_lost() == [stopped]

    after = group_instance_ids(clients, fleet.group_name)
    assert stopped not in after and len(after) == 2
    assert adapter.replace_lost() == []


def test_drill_starts_the_fleets_fis_template_and_reports_state(
    aws_endpoint: str, clients: AwsClients, fleet: MotoFleet
) -> None:
    adapter = _connect(aws_endpoint)

    drill = adapter.start_drill()

    experiment = clients.fis.get_experiment(id=drill.drill_id)["experiment"]
    assert experiment["experimentTemplateId"] == fleet.template_id
    assert drill.state is DrillState.PENDING
    # moto moves an experiment on by one state per read: it reaches completion.
    states = [adapter.drill_status(drill.drill_id).state for _ in range(4)]
    assert states[-1] is DrillState.COMPLETED
    assert states == sorted(states, key=[*DrillState].index)


def test_drill_with_an_unknown_template_is_a_fleet_error(
    aws_endpoint: str, fleet: MotoFleet
) -> None:
    with pytest.raises(FleetError, match="ResourceNotFound|not exist|does not exist"):
        _connect(aws_endpoint).start_drill("EXT0000000000")


def test_notices_from_eventbridge_reach_the_adapter_for_this_fleet_only(
    aws_endpoint: str, clients: AwsClients, fleet: MotoFleet
) -> None:
    ours = sorted(group_instance_ids(clients, fleet.group_name))
    theirs = sorted(group_instance_ids(clients, "other-workers-0001"))[0]
    put_spot_event(
        clients,
        AWS_INTERRUPTION_DETAIL_TYPE,
        {"instance-id": ours[0], "instance-action": "terminate"},
    )
    put_spot_event(clients, AWS_REBALANCE_DETAIL_TYPE, {"instance-id": ours[1]})
    put_spot_event(
        clients, AWS_INTERRUPTION_DETAIL_TYPE, {"instance-id": theirs, "instance-action": "stop"}
    )
    clients.sqs.send_message(QueueUrl=fleet.queue_url, MessageBody="not json at all")

    adapter = _connect(aws_endpoint)
    notices = adapter.receive_notices(wait_seconds=1)

    by_instance = {notice.instance_id: notice for notice in notices}
    assert set(by_instance) == set(ours)
    interruption = by_instance[ours[0]]
    assert interruption.action is NoticeAction.TERMINATE
    assert interruption.deadline_unix == pytest.approx(interruption.event_time_unix + 120)
    assert by_instance[ours[1]].action is NoticeAction.REBALANCE
    assert by_instance[ours[1]].deadline_unix is None
    # Everything read was consumed, the foreign event and the junk included.
    assert adapter.receive_notices(wait_seconds=0) == []


def test_notice_queue_is_found_by_fleet_name(aws_endpoint: str, fleet: MotoFleet) -> None:
    assert _connect(aws_endpoint).notice_queue_url().endswith("/demo-spot-notices")


def test_missing_group_is_a_fleet_error(aws_endpoint: str, fleet: MotoFleet) -> None:
    with pytest.raises(FleetError, match="expected one worker Auto Scaling group"):
        _connect(aws_endpoint, name="absent").set_capacity(2)


def test_rejected_requests_surface_as_fleet_errors(aws_endpoint: str, fleet: MotoFleet) -> None:
    adapter = _connect(aws_endpoint)
    with pytest.raises(FleetError, match="QueueDoesNotExist|NonExistentQueue|does not exist"):
        adapter.receive_notices(queue_url=f"{aws_endpoint}/123456789012/nope", wait_seconds=0)
    json.dumps([worker.as_row() for worker in adapter.list_workers()])  # rows are plain JSON


# ---- the on-demand fallback group ------------------------------------------------------------


def _desired(clients: AwsClients, group_name: str) -> int:
    groups = clients.autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[group_name])
    desired: int = groups["AutoScalingGroups"][0]["DesiredCapacity"]
    return desired


def test_fallback_group_is_found_by_its_tier_tag_and_scaled_on_demand(
    aws_endpoint: str, clients: AwsClients, fleet: MotoFleet
) -> None:
    fallback_name = create_fallback_group(clients, fleet, max_size=3)
    adapter = _connect(aws_endpoint)

    adapter.set_fallback_capacity(2)

    assert _desired(clients, fallback_name) == 2
    assert _desired(clients, fleet.group_name) == 2  # the spot group keeps its own size
    capacity = adapter.fallback_capacity()
    assert (capacity.group, capacity.count, capacity.max_count) == (fallback_name, 2, 3)
    adapter.set_fallback_capacity(0)
    assert _desired(clients, fallback_name) == 0


def test_the_fallback_group_does_not_count_as_a_second_spot_group(
    aws_endpoint: str, clients: AwsClients, fleet: MotoFleet
) -> None:
    fallback_name = create_fallback_group(clients, fleet, max_size=3)

    _connect(aws_endpoint).set_capacity(3)

    assert _desired(clients, fleet.group_name) == 3
    assert _desired(clients, fallback_name) == 0


def test_fallback_group_named_in_the_config(
    aws_endpoint: str, clients: AwsClients, fleet: MotoFleet
) -> None:
    fallback_name = create_fallback_group(clients, fleet, max_size=2)
    config = AwsFleetConfig(
        fleet_name="demo",
        region=REGION,
        fallback_group_name=fallback_name,
        endpoint_url=aws_endpoint,
    )

    AwsFleet.connect(config).set_fallback_capacity(1)

    assert _desired(clients, fallback_name) == 1


@pytest.mark.parametrize(
    ("count", "message"),
    [(-1, "must not be negative"), (4, "above the fallback group's maximum of 3")],
)
def test_a_fallback_count_outside_the_group_is_refused(
    aws_endpoint: str, clients: AwsClients, fleet: MotoFleet, count: int, message: str
) -> None:
    fallback_name = create_fallback_group(clients, fleet, max_size=3)

    with pytest.raises(FleetError, match=message):
        _connect(aws_endpoint).set_fallback_capacity(count)

    assert _desired(clients, fallback_name) == 0


def test_a_fleet_without_a_fallback_group_says_so(aws_endpoint: str, fleet: MotoFleet) -> None:
    adapter = _connect(aws_endpoint)
    with pytest.raises(FleetError, match="no on-demand fallback group"):
        adapter.set_fallback_capacity(1)
    with pytest.raises(FleetError, match="fallback_max_count"):
        adapter.fallback_capacity()


def test_capacity_reads_the_spot_groups_desired_capacity(
    aws_endpoint: str, clients: AwsClients, fleet: MotoFleet
) -> None:
    create_fallback_group(clients, fleet, max_size=3)
    adapter = _connect(aws_endpoint)

    assert adapter.capacity() == 2
    adapter.set_capacity(5)
    assert adapter.capacity() == 5


def test_autoscale_covers_a_stopped_spot_worker_then_releases_the_fallback(
    aws_endpoint: str, clients: AwsClients, fleet: MotoFleet
) -> None:
    fallback_name = create_fallback_group(clients, fleet, max_size=3)
    adapter = _connect(aws_endpoint)
    stopped = sorted(group_instance_ids(clients, fleet.group_name))[0]
    clients.ec2.stop_instances(InstanceIds=[stopped])

    grown = autoscale_fallback(adapter)

    assert (grown.spot_wanted, grown.spot_ready) == (2, 1)
    assert (grown.count_before, grown.count_after) == (0, 1)
    assert _desired(clients, fallback_name) == 1
    (launched,) = group_instance_ids(clients, fallback_name)
    by_id = {worker.instance_id: worker for worker in adapter.list_workers()}
    assert by_id[launched].is_fallback and not by_id[stopped].is_fallback

    # The fallback worker runs, but it is not a spot worker: nothing changes.
    unchanged = autoscale_fallback(adapter)
    assert (unchanged.spot_ready, unchanged.changed) == (1, False)

    clients.ec2.start_instances(InstanceIds=[stopped])
    released = autoscale_fallback(adapter)

    assert (released.spot_ready, released.count_after) == (2, 0)
    assert _desired(clients, fallback_name) == 0
