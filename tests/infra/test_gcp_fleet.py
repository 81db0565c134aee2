"""The GCP adapter end to end: real google-cloud-compute REST calls to a local Compute server."""

from __future__ import annotations

import pytest

from spotinfer.fleet import FleetError, GcpFleet, GcpFleetConfig, InstanceState, Lifecycle
from spotinfer.fleet.constants import (
    FALLBACK_TIER,
    FLEET_LABEL_KEY,
    ROLE_LABEL_KEY,
    TIER_LABEL_KEY,
)
from spotinfer.fleet.drill import DrillState
from tests.infra.fake_compute import FakeCompute, FakeInstance


def _labels(fleet: str, role: str = "worker") -> dict[str, str]:
    return {FLEET_LABEL_KEY: fleet, ROLE_LABEL_KEY: role}


def _connect(compute: FakeCompute, fallback_max_count: int | None = None) -> GcpFleet:
    config = GcpFleetConfig(
        fleet_name="demo",
        region="us-central1",
        project="spot-project",
        fallback_max_count=fallback_max_count,
        endpoint_url=compute.url,
    )
    return GcpFleet.connect(config)


@pytest.fixture
def fleet_vms(fake_compute: FakeCompute) -> FakeCompute:
    fake_compute.add(FakeInstance("demo-worker-b", "us-central1-b", labels=_labels("demo")))
    fake_compute.add(FakeInstance("demo-worker-a", "us-central1-a", labels=_labels("demo")))
    fake_compute.add(
        FakeInstance("demo-worker-c", "us-central1-c", status="TERMINATED", labels=_labels("demo"))
    )
    # Noise the adapter must leave out: another fleet, the coordinator, another region.
    fake_compute.add(FakeInstance("other-worker-a", "us-central1-a", labels=_labels("other")))
    fake_compute.add(
        FakeInstance(
            "demo-coordinator",
            "us-central1-a",
            labels=_labels("demo", "coordinator"),
            provisioning_model="STANDARD",
        )
    )
    fake_compute.add(FakeInstance("demo-worker-eu", "europe-west4-a", labels=_labels("demo")))
    return fake_compute


def test_list_workers_finds_the_fleet_by_label_in_its_region(fleet_vms: FakeCompute) -> None:
    workers = _connect(fleet_vms).list_workers()

    assert [worker.instance_id for worker in workers] == [
        "demo-worker-a",
        "demo-worker-b",
        "demo-worker-c",
    ]
    first = workers[0]
    assert first.zone == "us-central1-a"
    assert first.state is InstanceState.RUNNING
    assert first.lifecycle is Lifecycle.SPOT
    assert first.machine_type == "g2-standard-8"
    assert first.private_ip == "10.50.0.2"
    assert workers[2].state is InstanceState.STOPPED  # GCE TERMINATED = stopped, still a member
    request = fleet_vms.requests[-1]
    assert (request.method, request.path) == (
        "GET",
        "/compute/v1/projects/spot-project/aggregated/instances",
    )
    assert request.query["filter"] == [
        'labels.spotinfer-fleet = "demo" AND labels.spotinfer-role = "worker"'
    ]


def test_set_capacity_resizes_the_regional_group(fleet_vms: FakeCompute) -> None:
    _connect(fleet_vms).set_capacity(6)

    assert fleet_vms.target_size == 6
    request = fleet_vms.requests[-1]
    assert request.path.endswith("/regions/us-central1/instanceGroupManagers/demo-workers/resize")
    assert request.query["size"] == ["6"]


def test_replace_recreates_named_workers_through_the_group(fleet_vms: FakeCompute) -> None:
    replaced = _connect(fleet_vms).replace(["demo-worker-b"])

    assert replaced == ["demo-worker-b"]
    assert fleet_vms.recreated == ["demo-worker-b"]
    assert fleet_vms.requests[-1].body == {
        "instances": ["zones/us-central1-b/instances/demo-worker-b"]
    }


def test_replace_refuses_a_vm_outside_the_fleet_and_recreates_nothing(
    fleet_vms: FakeCompute,
) -> None:
    with pytest.raises(FleetError, match="other-worker-a"):
        _connect(fleet_vms).replace(["demo-worker-a", "other-worker-a"])

    assert fleet_vms.recreated == []


def test_replace_lost_recreates_only_stopped_workers(fleet_vms: FakeCompute) -> None:
    fleet = _connect(fleet_vms)

    assert fleet.replace_lost() == ["demo-worker-c"]
    assert fleet_vms.recreated == ["demo-worker-c"]
    # Nothing is lost any more: no second recreate call.
    calls = len(fleet_vms.requests)
    assert fleet.replace_lost() == []
    assert all(request.method == "GET" for request in fleet_vms.requests[calls:])


def test_drill_preempts_a_running_spot_worker_and_reports_progress(fleet_vms: FakeCompute) -> None:
    fleet = _connect(fleet_vms)

    drill = fleet.start_drill()

    assert drill.targets == ("demo-worker-a",)
    assert drill.state is DrillState.RUNNING
    assert drill.drill_id.startswith("us-central1-a/operation-")
    request = fleet_vms.requests[-1]
    assert request.path.endswith(
        "/zones/us-central1-a/instances/demo-worker-a/simulateMaintenanceEvent"
    )
    assert fleet_vms.instances["demo-worker-a"].status == "STOPPING"

    finished = fleet.drill_status(drill.drill_id)
    assert finished.state is DrillState.COMPLETED
    assert finished.targets == ("demo-worker-a",)
    assert fleet.list_workers()[0].state is InstanceState.STOPPED


def test_drill_on_a_named_worker_and_on_a_stranger(fleet_vms: FakeCompute) -> None:
    fleet = _connect(fleet_vms)

    assert fleet.start_drill("demo-worker-b").targets == ("demo-worker-b",)
    with pytest.raises(FleetError, match="not a worker"):
        fleet.start_drill("other-worker-a")


def test_cloud_errors_become_fleet_errors(fake_compute: FakeCompute) -> None:
    config = GcpFleetConfig(
        fleet_name="demo",
        region="us-central1",
        project="spot-project",
        group_name="no-such-group",
        endpoint_url=fake_compute.url,
    )
    fleet = GcpFleet.connect(config)

    with pytest.raises(FleetError, match="404"):
        fleet.set_capacity(3)
    with pytest.raises(FleetError, match="ZONE/OPERATION"):
        fleet.drill_status("no-slash")
    with pytest.raises(FleetError, match="404"):
        fleet.drill_status("us-central1-a/operation-missing")


# ---- the on-demand fallback group ------------------------------------------------------------


def test_fallback_capacity_resizes_the_fallback_group_not_the_spot_one(
    fleet_vms: FakeCompute,
) -> None:
    fleet_vms.other_groups["demo-fallback"] = 0
    fleet = _connect(fleet_vms, fallback_max_count=3)

    fleet.set_fallback_capacity(2)

    assert fleet_vms.other_groups["demo-fallback"] == 2
    assert fleet_vms.target_size == 0  # the spot group is untouched
    request = fleet_vms.requests[-1]
    assert request.path.endswith("/regions/us-central1/instanceGroupManagers/demo-fallback/resize")
    capacity = fleet.fallback_capacity()
    assert (capacity.group, capacity.count, capacity.max_count) == ("demo-fallback", 2, 3)

    fleet.set_fallback_capacity(0)
    assert fleet_vms.other_groups["demo-fallback"] == 0


@pytest.mark.parametrize(
    ("count", "message"), [(-1, "must not be negative"), (4, "above the fallback group's maximum")]
)
def test_a_fallback_count_outside_its_bounds_is_refused_before_any_call(
    fleet_vms: FakeCompute, count: int, message: str
) -> None:
    fleet_vms.other_groups["demo-fallback"] = 1
    fleet = _connect(fleet_vms, fallback_max_count=3)
    calls = len(fleet_vms.requests)

    with pytest.raises(FleetError, match=message):
        fleet.set_fallback_capacity(count)

    assert fleet_vms.requests[calls:] == []
    assert fleet_vms.other_groups["demo-fallback"] == 1


def test_a_fleet_without_a_fallback_group_says_so(fleet_vms: FakeCompute) -> None:
    with pytest.raises(FleetError, match="no on-demand fallback group configured"):
        _connect(fleet_vms).set_fallback_capacity(1)
    # Configured, but Terraform created no group (fallback_max_count 0 there).
    with pytest.raises(FleetError, match="has no fallback group demo-fallback"):
        _connect(fleet_vms, fallback_max_count=2).set_fallback_capacity(1)
    with pytest.raises(FleetError, match="has no fallback group demo-fallback"):
        _connect(fleet_vms, fallback_max_count=2).fallback_capacity()


def test_a_lost_fallback_worker_is_recreated_through_the_fallback_group(
    fleet_vms: FakeCompute,
) -> None:
    fleet_vms.other_groups["demo-fallback"] = 1
    fleet_vms.add(
        FakeInstance(
            "demo-fallback-x",
            "us-central1-a",
            status="TERMINATED",
            labels={**_labels("demo"), TIER_LABEL_KEY: FALLBACK_TIER},
            provisioning_model="STANDARD",
        )
    )

    replaced = _connect(fleet_vms).replace_lost()

    assert replaced == ["demo-fallback-x", "demo-worker-c"]
    recreates = {
        request.path.rsplit("/", 2)[-2]: request.body["instances"]
        for request in fleet_vms.requests
        if request.path.endswith("/recreateInstances")
    }
    assert recreates == {
        "demo-fallback": ["zones/us-central1-a/instances/demo-fallback-x"],
        "demo-workers": ["zones/us-central1-c/instances/demo-worker-c"],
    }
