"""The GCP fleet adapter: a regional managed instance group of Spot VMs (google-cloud-compute).

What it expects is what infra/terraform/gcp creates: worker VMs labelled
``spotinfer-fleet=NAME`` and ``spotinfer-role=worker`` in the regional managed instance group
``NAME-workers``, and optionally an on-demand fallback group ``NAME-fallback``. The REST calls
it makes (all under ``/compute/v1/projects/PROJECT``):

    GET  /aggregated/instances?filter=labels.spotinfer-fleet = "NAME" AND …   list_workers
    GET  /regions/R/instanceGroupManagers/G                                    capacity
    POST /regions/R/instanceGroupManagers/G/resize?size=N                      set_capacity
    GET  /regions/R/instanceGroupManagers/NAME-fallback                        fallback_capacity
    POST /regions/R/instanceGroupManagers/NAME-fallback/resize?size=N          set_fallback_capacity
    POST /regions/R/instanceGroupManagers/G/recreateInstances                  replace
    POST /zones/Z/instances/I/simulateMaintenanceEvent                         start_drill
    GET  /zones/Z/operations/OP                                                drill_status

On a Spot VM (on_host_maintenance TERMINATE) a simulated maintenance event is a preemption:
the VM's metadata server flips ``instance/preempted`` to TRUE and the VM is stopped or
deleted after the notice. google-cloud-compute is imported by ``connect`` only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from spotinfer.fleet.adapter import Fleet
from spotinfer.fleet.config import GcpFleetConfig
from spotinfer.fleet.constants import (
    FALLBACK_TIER,
    FLEET_LABEL_KEY,
    ROLE_LABEL_KEY,
    TIER_LABEL_KEY,
    WORKER_ROLE,
)
from spotinfer.fleet.drill import DrillRun, DrillState
from spotinfer.fleet.errors import FleetError
from spotinfer.fleet.fallback import FallbackCapacity, check_fallback_count
from spotinfer.fleet.instance import FleetInstance, InstanceState, Lifecycle

T = TypeVar("T")

_GCE_STATES = {
    "PROVISIONING": InstanceState.PROVISIONING,
    "STAGING": InstanceState.PROVISIONING,
    "RUNNING": InstanceState.RUNNING,
    "STOPPING": InstanceState.STOPPING,
    "SUSPENDING": InstanceState.STOPPING,
    "REPAIRING": InstanceState.STOPPING,
    # GCE's TERMINATED is a stopped VM that still exists (and still holds its group slot).
    "TERMINATED": InstanceState.STOPPED,
    "STOPPED": InstanceState.STOPPED,
    "SUSPENDED": InstanceState.STOPPED,
}


def _call(what: str, request: Callable[[], T], not_found: str | None = None) -> T:
    """Run one Compute API request; the client library's errors become FleetError
    (``not_found``, if given, is the message for a 404)."""
    from google.api_core.exceptions import GoogleAPICallError, NotFound, RetryError

    try:
        return request()
    except NotFound as error:
        raise FleetError(not_found or f"{what}: {error.code} {error.message}") from error
    except GoogleAPICallError as error:
        raise FleetError(f"{what}: {error.code} {error.message}") from error
    except RetryError as error:
        raise FleetError(f"{what}: gave up retrying: {error}") from error


def _last_segment(url_or_name: str) -> str:
    """``…/zones/us-central1-a`` -> ``us-central1-a``; a bare name stays as it is."""
    return url_or_name.rstrip("/").rsplit("/", 1)[-1]


def _enum_name(value: Any) -> str:
    # Compute's proto-plus messages give some enums as str, some as enum members.
    return str(getattr(value, "name", value))


def _instance_from_gce(instance: Any) -> FleetInstance:
    interfaces = list(instance.network_interfaces)
    is_spot = _enum_name(instance.scheduling.provisioning_model) == "SPOT"
    is_fallback = instance.labels.get(TIER_LABEL_KEY) == FALLBACK_TIER
    return FleetInstance(
        instance_id=instance.name,
        zone=_last_segment(instance.zone),
        state=_GCE_STATES.get(_enum_name(instance.status), InstanceState.STOPPING),
        lifecycle=Lifecycle.SPOT if is_spot else Lifecycle.ON_DEMAND,
        machine_type=_last_segment(instance.machine_type),
        private_ip=(interfaces[0].network_i_p or None) if interfaces else None,
        is_fallback=is_fallback,
    )


def _drill_from_operation(operation: Any, zone: str, target: str | None) -> DrillRun:
    status = _enum_name(operation.status)
    errors = list(operation.error.errors) if operation.error else []
    if status == "DONE":
        state = DrillState.FAILED if errors else DrillState.COMPLETED
    elif status == "RUNNING":
        state = DrillState.RUNNING
    else:
        state = DrillState.PENDING
    detail = "; ".join(f"{error.code}: {error.message}" for error in errors)
    return DrillRun(
        cloud="gcp",
        drill_id=f"{zone}/{operation.name}",
        state=state,
        targets=(target,) if target else (),
        detail=detail or operation.status_message or "",
    )


class GcpFleet(Fleet, cloud="gcp"):
    """A spotinfer fleet on GCE; clients are google-cloud-compute ``InstancesClient``,
    ``RegionInstanceGroupManagersClient`` and ``ZoneOperationsClient``."""

    config_class = GcpFleetConfig

    def __init__(
        self,
        config: GcpFleetConfig,
        *,
        instances: Any,
        group_managers: Any,
        zone_operations: Any,
    ) -> None:
        self.config = config
        self._instances = instances
        self._group_managers = group_managers
        self._zone_operations = zone_operations

    @classmethod
    def connect(cls, config: GcpFleetConfig) -> GcpFleet:
        from google.auth.exceptions import DefaultCredentialsError
        from google.cloud import compute_v1

        options: dict[str, Any] = {}
        if config.endpoint_url:
            # A local emulator checks no credentials; don't go looking for any.
            from google.auth.credentials import AnonymousCredentials

            options = {
                "credentials": AnonymousCredentials(),
                "client_options": {"api_endpoint": config.endpoint_url},
            }
        try:
            return cls(
                config,
                instances=compute_v1.InstancesClient(**options),
                group_managers=compute_v1.RegionInstanceGroupManagersClient(**options),
                zone_operations=compute_v1.ZoneOperationsClient(**options),
            )
        except DefaultCredentialsError as error:
            raise FleetError(
                f"no Google credentials: {error} (run `gcloud auth application-default login`)"
            ) from error

    # ---- workers -------------------------------------------------------------------------

    def _label_filter(self) -> str:
        return (
            f'labels.{FLEET_LABEL_KEY} = "{self.config.fleet_name}" AND '
            f'labels.{ROLE_LABEL_KEY} = "{WORKER_ROLE}"'
        )

    def list_workers(self) -> list[FleetInstance]:
        return self._list(self._label_filter())

    def _list(self, label_filter: str) -> list[FleetInstance]:
        request = {"project": self.config.project, "filter": label_filter}
        scopes = _call(
            "list instances", lambda: list(self._instances.aggregated_list(request=request))
        )
        zone_prefix = f"zones/{self.config.region}-"
        workers = [
            _instance_from_gce(instance)
            for scope_name, scoped in scopes
            if scope_name.startswith(zone_prefix)
            for instance in scoped.instances
        ]
        return sorted(workers, key=lambda worker: worker.instance_id)

    def _target_size(self, group: str, kind: str) -> int:
        manager = _call(
            f"get instance group {group}",
            lambda: self._group_managers.get(
                project=self.config.project,
                region=self.config.region,
                instance_group_manager=group,
            ),
            not_found=f"fleet {self.config.fleet_name} has no {kind} {group}",
        )
        return int(manager.target_size)

    def capacity(self) -> int:
        return self._target_size(self.config.group, "worker group")

    def set_capacity(self, worker_count: int) -> None:
        if worker_count < 0:
            raise FleetError(f"worker count must not be negative, got {worker_count}")
        _call(
            "resize the instance group",
            lambda: self._group_managers.resize(
                project=self.config.project,
                region=self.config.region,
                instance_group_manager=self.config.group,
                size=worker_count,
            ),
        )

    def _fallback_max_count(self) -> int:
        max_count = self.config.fallback_max_count
        if not max_count:
            raise FleetError(
                f"fleet {self.config.fleet_name} has no on-demand fallback group configured: "
                "pass --fallback-max-count (the Terraform output fallback_max_count; a managed "
                "instance group keeps no maximum of its own)"
            )
        return max_count

    def fallback_capacity(self) -> FallbackCapacity:
        max_count = self._fallback_max_count()
        group = self.config.fallback_group
        count = self._target_size(group, "fallback group")
        return FallbackCapacity(group=group, count=count, max_count=max_count)

    def set_fallback_capacity(self, worker_count: int) -> None:
        check_fallback_count(worker_count, self._fallback_max_count())
        group = self.config.fallback_group
        _call(
            "resize the fallback group",
            lambda: self._group_managers.resize(
                project=self.config.project,
                region=self.config.region,
                instance_group_manager=group,
                size=worker_count,
            ),
            not_found=f"fleet {self.config.fleet_name} has no fallback group {group}",
        )

    def _recreate(self, workers: Sequence[FleetInstance]) -> list[str]:
        """Recreate each worker through its own group: the spot one or the fallback one."""
        by_group: dict[str, list[str]] = {}
        for worker in workers:
            group = self.config.fallback_group if worker.is_fallback else self.config.group
            by_group.setdefault(group, []).append(
                f"zones/{worker.zone}/instances/{worker.instance_id}"
            )
        for group, urls in by_group.items():
            request = functools.partial(
                self._group_managers.recreate_instances,
                project=self.config.project,
                region=self.config.region,
                instance_group_manager=group,
                region_instance_group_managers_recreate_request_resource={"instances": urls},
            )
            _call(f"recreate instances of {group}", request)
        return [worker.instance_id for worker in workers]

    def replace(self, instance_ids: Sequence[str]) -> list[str]:
        self._check_members(instance_ids)
        by_id = {worker.instance_id: worker for worker in self.list_workers()}
        return self._recreate([by_id[instance_id] for instance_id in instance_ids])

    def replace_lost(self) -> list[str]:
        lost = [worker for worker in self.list_workers() if worker.state.is_lost]
        return self._recreate(lost) if lost else []

    # ---- drills --------------------------------------------------------------------------

    def start_drill(self, target: str | None = None) -> DrillRun:
        """Preempt one spot worker: ``target``, or the first running one by name."""
        workers = self.list_workers()
        if target is None:
            running = [
                worker
                for worker in workers
                if worker.state is InstanceState.RUNNING and worker.lifecycle is Lifecycle.SPOT
            ]
            if not running:
                raise FleetError("no running spot worker to drill")
            chosen = running[0]
        else:
            by_id = {worker.instance_id: worker for worker in workers}
            if target not in by_id:
                raise FleetError(f"{target} is not a worker of fleet {self.config.fleet_name}")
            chosen = by_id[target]
        operation = _call(
            f"simulate a maintenance event on {chosen.instance_id}",
            lambda: self._instances.simulate_maintenance_event(
                project=self.config.project, zone=chosen.zone, instance=chosen.instance_id
            ),
        )
        return _drill_from_operation(operation, chosen.zone, chosen.instance_id)

    def drill_status(self, drill_id: str) -> DrillRun:
        zone, _, operation_name = drill_id.partition("/")
        if not zone or not operation_name:
            raise FleetError(f"a GCP drill id is ZONE/OPERATION, got {drill_id!r}")
        operation = _call(
            f"get operation {operation_name}",
            lambda: self._zone_operations.get(
                project=self.config.project, zone=zone, operation=operation_name
            ),
        )
        target = _last_segment(operation.target_link) if operation.target_link else None
        return _drill_from_operation(operation, zone, target)
