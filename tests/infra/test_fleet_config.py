"""Fleet configs refuse bad locations on construction; adapters are picked by cloud name."""

from __future__ import annotations

import pytest

from spotinfer.fleet import (
    AwsFleet,
    AwsFleetConfig,
    FleetError,
    GcpFleet,
    GcpFleetConfig,
    connect_fleet,
    fleet_class,
    registered_clouds,
)


def test_registry_knows_both_clouds() -> None:
    assert registered_clouds() == ["aws", "gcp"]
    assert fleet_class("aws") is AwsFleet
    assert fleet_class("gcp") is GcpFleet
    with pytest.raises(FleetError, match="azure"):
        fleet_class("azure")


def test_connect_checks_the_config_matches_the_cloud() -> None:
    with pytest.raises(FleetError, match="GcpFleetConfig"):
        connect_fleet("gcp", AwsFleetConfig(fleet_name="demo", region="us-east-1"))


@pytest.mark.parametrize(
    "options",
    [
        {"fleet_name": "Demo", "region": "us-east-1"},
        {"fleet_name": "d", "region": "us-east-1"},
        {"fleet_name": "demo", "region": "useast1"},
        {"fleet_name": "demo", "region": "us-east-1", "group_name": " "},
        {"fleet_name": "demo", "region": "us-east-1", "fallback_group_name": ""},
        {"fleet_name": "demo", "region": "us-east-1", "endpoint_url": "localhost:5000"},
    ],
)
def test_bad_aws_locations_are_refused(options: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        AwsFleetConfig(**options)


@pytest.mark.parametrize(
    "options",
    [
        {"fleet_name": "demo", "region": "us-central1", "project": "P"},
        {"fleet_name": "demo", "region": "us-central1-a", "project": "spot-project"},
        {"fleet_name": "demo_1", "region": "us-central1", "project": "spot-project"},
        {
            "fleet_name": "demo",
            "region": "us-central1",
            "project": "spot-project",
            "fallback_max_count": -1,
        },
    ],
)
def test_bad_gcp_locations_are_refused(options: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        GcpFleetConfig(**options)


def test_gcp_group_defaults_to_the_terraform_name() -> None:
    config = GcpFleetConfig(fleet_name="demo", region="us-central1", project="spot-project")
    assert config.group == "demo-workers"
    named = GcpFleetConfig(
        fleet_name="demo", region="us-central1", project="spot-project", group_name="mine"
    )
    assert named.group == "mine"


def test_gcp_fallback_group_defaults_to_the_terraform_name() -> None:
    config = GcpFleetConfig(fleet_name="demo", region="us-central1", project="spot-project")
    assert config.fallback_group == "demo-fallback"
