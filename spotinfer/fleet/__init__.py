"""Spot fleets in the clouds: discover workers, keep capacity, read notices, run drills.

Adapters are picked by cloud name (``fleet_class("aws")``, ``connect_fleet("gcp", config)``);
importing this package registers both. Neither imports its cloud SDK until ``connect``.
"""

from spotinfer.fleet import aws, gcp  # noqa: F401  (registers the adapters)
from spotinfer.fleet.adapter import Fleet, connect_fleet, fleet_class, registered_clouds
from spotinfer.fleet.aws import AwsFleet
from spotinfer.fleet.aws_events import notice_from_event
from spotinfer.fleet.config import AwsFleetConfig, GcpFleetConfig
from spotinfer.fleet.drill import DrillRun, DrillState
from spotinfer.fleet.errors import FleetError, FleetEventError
from spotinfer.fleet.fallback import (
    FallbackCapacity,
    FallbackDecision,
    autoscale_fallback,
    fallback_count_wanted,
)
from spotinfer.fleet.gcp import GcpFleet
from spotinfer.fleet.instance import FleetInstance, InstanceState, Lifecycle
from spotinfer.fleet.notice import FleetNotice

__all__ = [
    "AwsFleet",
    "AwsFleetConfig",
    "DrillRun",
    "DrillState",
    "FallbackCapacity",
    "FallbackDecision",
    "Fleet",
    "FleetError",
    "FleetEventError",
    "FleetInstance",
    "FleetNotice",
    "GcpFleet",
    "GcpFleetConfig",
    "InstanceState",
    "Lifecycle",
    "autoscale_fallback",
    "connect_fleet",
    "fallback_count_wanted",
    "fleet_class",
    "notice_from_event",
    "registered_clouds",
]
