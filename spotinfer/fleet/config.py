"""Where a fleet lives: one frozen config per cloud, validated on construction.

Each field's ``metadata["help"]`` is its documentation and its CLI help:
``spotinfer fleet`` derives one flag per field (``fleet_name`` -> ``--fleet-name``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from spotinfer.fleet.constants import GCP_GROUP_SUFFIX

# Same rule as the Terraform modules' `name` variables (the GCP one allows 20 characters).
_FLEET_NAME = re.compile(r"^[a-z][a-z0-9-]{1,19}$")
_AWS_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d+$")
_GCP_REGION = re.compile(r"^[a-z]+-[a-z]+\d+$")
_GCP_PROJECT = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")


def _check_endpoint(endpoint_url: str | None) -> None:
    if endpoint_url is not None and not re.match(r"^https?://[^/\s]+", endpoint_url):
        raise ValueError(f"endpoint_url must be an http(s) URL, got {endpoint_url!r}")


def _check_fleet_name(fleet_name: str) -> None:
    if not _FLEET_NAME.match(fleet_name):
        raise ValueError(
            f"fleet_name must be 2-20 lowercase letters, digits or '-', starting with a letter "
            f"(the Terraform `name`), got {fleet_name!r}"
        )


@dataclass(frozen=True)
class AwsFleetConfig:
    fleet_name: str = field(
        metadata={"help": "fleet name: the value of the spotinfer:fleet tag (Terraform `name`)"}
    )
    region: str = field(metadata={"help": "AWS region of the fleet, e.g. us-east-1"})
    group_name: str | None = field(
        default=None,
        metadata={
            "help": "workers' Auto Scaling group; default: the group tagged with the fleet name"
        },
    )
    endpoint_url: str | None = field(
        default=None,
        metadata={"help": "AWS API endpoint to use instead of the region's (a local emulator)"},
    )

    def __post_init__(self) -> None:
        _check_fleet_name(self.fleet_name)
        if not _AWS_REGION.match(self.region):
            raise ValueError(f"region must look like us-east-1, got {self.region!r}")
        if self.group_name is not None and not self.group_name.strip():
            raise ValueError("group_name must not be empty")
        _check_endpoint(self.endpoint_url)


@dataclass(frozen=True)
class GcpFleetConfig:
    fleet_name: str = field(
        metadata={"help": "fleet name: the value of the spotinfer-fleet label (Terraform `name`)"}
    )
    region: str = field(metadata={"help": "GCP region of the fleet, e.g. us-central1"})
    project: str = field(metadata={"help": "GCP project id"})
    group_name: str | None = field(
        default=None,
        metadata={"help": "workers' regional managed instance group; default: FLEET-workers"},
    )
    endpoint_url: str | None = field(
        default=None,
        metadata={"help": "Compute API endpoint to use instead of Google's (a local emulator)"},
    )

    def __post_init__(self) -> None:
        _check_fleet_name(self.fleet_name)
        if not _GCP_REGION.match(self.region):
            raise ValueError(f"region must look like us-central1, got {self.region!r}")
        if not _GCP_PROJECT.match(self.project):
            raise ValueError(f"project must be a GCP project id, got {self.project!r}")
        if self.group_name is not None and not self.group_name.strip():
            raise ValueError("group_name must not be empty")
        _check_endpoint(self.endpoint_url)

    @property
    def group(self) -> str:
        """The managed instance group's name (the Terraform module's default naming)."""
        return self.group_name or f"{self.fleet_name}{GCP_GROUP_SUFFIX}"


FleetConfig = AwsFleetConfig | GcpFleetConfig


def config_from_options(config_class: type[Any], options: dict[str, Any]) -> Any:
    """Build ``config_class`` from a dict that may hold other clouds' options too."""
    names = {name for name in config_class.__dataclass_fields__}
    return config_class(**{key: value for key, value in options.items() if key in names})
