"""Routing policies: which of the workers with room takes a request.

A policy is a class registered by name (`class Mine(RoutingPolicy, name="mine")`) and picked by
`--routing-policy`. It only chooses: admission has already kept out every worker that is not
READY, not ACTIVE, or has no slot left for the request's SLA class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from common.requests import GenerationRequest
from coordinator.registry import WorkerEntry


class RoutingPolicy:
    """Picks one of ``candidates`` (never empty) for ``request``. No side effects on them."""

    _by_name: ClassVar[dict[str, type[RoutingPolicy]]] = {}
    name: ClassVar[str]

    def __init_subclass__(cls, name: str, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if name in RoutingPolicy._by_name:
            raise ValueError(f"routing policy {name!r} is already registered")
        cls.name = name
        RoutingPolicy._by_name[name] = cls

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(sorted(cls._by_name))

    @classmethod
    def create(cls, name: str) -> RoutingPolicy:
        try:
            return cls._by_name[name]()
        except KeyError:
            raise ValueError(
                f"unknown routing policy {name!r}; known: {', '.join(cls.names())}"
            ) from None

    def choose(self, request: GenerationRequest, candidates: Sequence[WorkerEntry]) -> WorkerEntry:
        raise NotImplementedError


class LeastLoaded(RoutingPolicy, name="least-loaded"):
    """Most KV headroom first (a long request needs blocks, and running out of them is what
    makes vLLM preempt and recompute), then fewest requests in flight, then fewest running."""

    def choose(self, request: GenerationRequest, candidates: Sequence[WorkerEntry]) -> WorkerEntry:
        def load(entry: WorkerEntry) -> tuple[int, int, int]:
            running = entry.capacity.running_seqs if entry.capacity else 0
            return (-entry.kv_headroom_blocks, entry.in_flight_total, running)

        return min(candidates, key=load)


class RoundRobin(RoutingPolicy, name="round-robin"):
    """Each worker in turn, whatever its load (a baseline to compare policies against)."""

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: GenerationRequest, candidates: Sequence[WorkerEntry]) -> WorkerEntry:
        ordered = sorted(candidates, key=lambda e: e.address)
        self._turn += 1
        return ordered[self._turn % len(ordered)]
