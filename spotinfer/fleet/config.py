"""Where a fleet lives: one frozen config per cloud, validated on construction.

Each field's ``metadata["help"]`` is its documentation and its CLI help:
``spotinfer fleet`` derives one flag per field (``fleet_name`` -> ``--fleet-name``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from spotinfer.fleet.constants import GCP_FALLBACK_GROUP_SUFFIX, GCP_GROUP_SUFFIX

# Same rule as the Terraform modules' `name` variables (the GCP one allows 20 characters).
_FLEET_NAME = re.compile(r"^[a-z][a-z0-9-]{1,19}$")
_AWS_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d+$")
_GCP_REGION = re.compile(r"^[a-z]+-[a-z]+\d+$")
_GCP_PROJECT = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")


def _check_endpoint(endpoint_url: str | None) -> None:
    if endpoint_url is not None and not re.match(r"^https?://[^/\s]+", endpoint_url):
        raise ValueError(f"endpoint_url must be an http(s) URL, got {endpoint_url!r}")


def _check_group_names(config: Any) -> None:
    for name in ("group_name", "fallback_group_name"):
        group_name = getattr(config, name)
        if group_name is not None and not group_name.strip():
            raise ValueError(f"{name} must not be empty")


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
    fallback_group_name: str | None = field(
        default=None,
        metadata={
            "help": "on-demand fallback workers' Auto Scaling group (Terraform output "
            "fallback_asg_name); default: the fleet's group tagged spotinfer:tier=fallback"
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
        _check_group_names(self)
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
    fallback_group_name: str | None = field(
        default=None,
        metadata={
            "help": "on-demand fallback workers' regional managed instance group; "
            "default: FLEET-fallback"
        },
    )
    fallback_max_count: int | None = field(
        default=None,
        metadata={
            "help": "most fallback workers (Terraform output fallback_max_count; a managed "
            "instance group keeps no maximum of its own); needed to scale the fallback"
        },
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
        _check_group_names(self)
        if self.fallback_max_count is not None and self.fallback_max_count < 0:
            raise ValueError(
                f"fallback_max_count must not be negative, got {self.fallback_max_count}"
            )
        _check_endpoint(self.endpoint_url)

    @property
    def group(self) -> str:
        """The managed instance group's name (the Terraform module's default naming)."""
        return self.group_name or f"{self.fleet_name}{GCP_GROUP_SUFFIX}"

    @property
    def fallback_group(self) -> str:
        """The fallback managed instance group's name (the Terraform module's naming)."""
        return self.fallback_group_name or f"{self.fleet_name}{GCP_FALLBACK_GROUP_SUFFIX}"


FleetConfig = AwsFleetConfig | GcpFleetConfig


def config_from_options(config_class: type[Any], options: dict[str, Any]) -> Any:
    """Build ``config_class`` from a dict that may hold other clouds' options too."""
    names = {name for name in config_class.__dataclass_fields__}
    return config_class(**{key: value for key, value in options.items() if key in names})
