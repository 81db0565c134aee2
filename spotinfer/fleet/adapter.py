"""The fleet adapter interface and its registry, keyed by cloud name (``aws``, ``gcp``).

An adapter speaks to one cloud's APIs about one fleet: the spot workers the Terraform in
infra/terraform created. Adapters are picked by name (``fleet_class("aws")``); a class joins
the registry by naming its cloud: ``class AwsFleet(Fleet, cloud="aws")``. Cloud clients come
in through the constructor; ``connect(config)`` is the factory that builds real ones.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

from spotinfer.fleet.drill import DrillRun
from spotinfer.fleet.errors import FleetError
from spotinfer.fleet.fallback import FallbackCapacity
from spotinfer.fleet.instance import FleetInstance

_REGISTRY: dict[str, type[Fleet]] = {}


class Fleet(abc.ABC):
    """One cloud's view of a spotinfer worker fleet.

    Side effects: ``list_workers``, ``capacity``, ``fallback_capacity`` and ``drill_status``
    only read.
    ``set_capacity``, ``set_fallback_capacity``, ``replace``, ``replace_lost`` and
    ``start_drill`` change the fleet and return once the cloud has accepted the request, not
    when it is carried out. Invariant: every method raises FleetError (never a client
    library's exception) when the cloud refuses.

    ``capacity``, ``set_capacity``, ``replace`` and ``replace_lost`` act on the spot workers'
    group; ``list_workers`` lists the workers of both groups, telling them apart by
    ``FleetInstance.is_fallback``.
    """

    cloud: ClassVar[str]
    config_class: ClassVar[type[Any]]

    def __init_subclass__(cls, cloud: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cloud is not None:
            if cloud in _REGISTRY:
                raise ValueError(f"fleet adapter for {cloud!r} registered twice")
            cls.cloud = cloud
            _REGISTRY[cloud] = cls

    @classmethod
    @abc.abstractmethod
    def connect(cls, config: Any) -> Fleet:
        """An adapter with real cloud clients for ``config`` (imports the cloud's SDK)."""

    @abc.abstractmethod
    def list_workers(self) -> list[FleetInstance]:
        """The fleet's worker VMs (found by tag / label), sorted by id."""

    @abc.abstractmethod
    def capacity(self) -> int:
        """The workers asked for (Auto Scaling desired capacity / MIG target size), not
        necessarily running."""

    @abc.abstractmethod
    def set_capacity(self, worker_count: int) -> None:
        """Ask for ``worker_count`` workers (Auto Scaling desired capacity / MIG size)."""

    @abc.abstractmethod
    def fallback_capacity(self) -> FallbackCapacity:
        """The on-demand fallback group's size and maximum.

        Raises FleetError if the fleet has no fallback group (Terraform fallback_max_count 0).
        """

    @abc.abstractmethod
    def set_fallback_capacity(self, worker_count: int) -> None:
        """Ask for ``worker_count`` on-demand fallback workers (0 releases them all).

        Raises FleetError, changing nothing, if the fleet has no fallback group or the count
        is outside 0..max_count.
        """

    @abc.abstractmethod
    def replace(self, instance_ids: Sequence[str]) -> list[str]:
        """Replace these workers with fresh ones, keeping the capacity; returns the ids.

        Raises FleetError, replacing nothing, if any id is not a worker of the fleet.
        """

    @abc.abstractmethod
    def replace_lost(self) -> list[str]:
        """Replace every worker that holds a place but serves nothing (stopped, terminated)."""

    @abc.abstractmethod
    def start_drill(self, target: str | None = None) -> DrillRun:
        """Start a preemption drill (``target``: template id on AWS, instance name on GCP)."""

    @abc.abstractmethod
    def drill_status(self, drill_id: str) -> DrillRun:
        """The drill's current state."""

    def _worker_ids(self) -> set[str]:
        return {worker.instance_id for worker in self.list_workers()}

    def _check_members(self, instance_ids: Sequence[str]) -> None:
        if not instance_ids:
            raise FleetError("no instance given to replace")
        strangers = sorted(set(instance_ids) - self._worker_ids())
        if strangers:
            raise FleetError(f"not workers of this fleet: {', '.join(strangers)}")


def fleet_class(cloud: str) -> type[Fleet]:
    """The adapter class registered for ``cloud``."""
    try:
        return _REGISTRY[cloud]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise FleetError(f"no fleet adapter for cloud {cloud!r} (known: {known})") from None


def registered_clouds() -> list[str]:
    return sorted(_REGISTRY)


def connect_fleet(cloud: str, config: Any) -> Fleet:
    """A connected adapter for ``cloud``; ``config`` must be that adapter's config class."""
    adapter = fleet_class(cloud)
    if not isinstance(config, adapter.config_class):
        raise FleetError(
            f"{cloud} needs a {adapter.config_class.__name__}, got {type(config).__name__}"
        )
    return adapter.connect(config)
