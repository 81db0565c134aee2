"""Spot availability over time, per zone: how many spot nodes the cloud lets the fleet hold.

A trace is a list of capacity changes. A drop is the cloud taking nodes back: that many of
the fleet's spot nodes in the zone get a notice (the cloud's grace) if the fleet held more
than is left; a rise is capacity coming back (the fleet may launch nodes there again).

    SpotServe trace (count of nodes) ──scale to the fleet──▶ ──tile to the run──▶ CapacityEvent…
    generated waves (per zone)  ─────────────────────────────────────────────▶ CapacityEvent…

Generated waves follow what published studies say of spot interruptions: they come in waves,
one instance type in one zone at a time, tightly clustered (a 2026 study of 336k spot
requests: > 92% of the interruptions of one type in one zone within 3 minutes of each other,
as quoted in the project's design notes). The wave rate, depth and outage length are the
run's parameters, stated in its report; defaults are assumptions, not measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spotinfer.drills.scenarios import read_trace

WAVE_CLUSTER_SECONDS = 180.0  # > 92% of a wave's interruptions within 3 minutes (see above)


@dataclass(frozen=True)
class CapacityEvent:
    time_seconds: float
    zone: str
    capacity: int  # spot nodes the zone allows from now on


@dataclass(frozen=True)
class AvailabilityTrace:
    name: str
    initial: dict[str, int]  # zone → capacity at t = 0
    events: tuple[CapacityEvent, ...]
    span_seconds: float

    @property
    def zones(self) -> tuple[str, ...]:
        return tuple(sorted(self.initial))

    def notices(self) -> int:
        """Capacity taken back over the trace (node-notices if the fleet held it all)."""
        last = dict(self.initial)
        taken = 0
        for event in self.events:
            taken += max(0, last[event.zone] - event.capacity)
            last[event.zone] = event.capacity
        return taken


def unlimited(zones: tuple[str, ...], span_seconds: float) -> AvailabilityTrace:
    """No interruptions: every zone holds as many spot nodes as wanted."""
    return AvailabilityTrace("none", {z: 1 << 30 for z in zones}, (), span_seconds)


def spotserve(path: Path, zone: str = "a") -> AvailabilityTrace:
    """SpotServe's format (`[time_ms, add|remove|DONE, {"nodes": [...]}]`) as a node count."""
    count, initial_set = 0, False
    initial = 0
    events: list[CapacityEvent] = []
    span = 0.0
    for when_ms, action, payload in read_trace(path):
        span = max(span, when_ms / 1000)
        if action == "DONE":
            break
        delta = len(payload["nodes"]) * (1 if action == "add" else -1)
        count += delta
        if not initial_set and when_ms == 0:
            initial = count
            continue
        initial_set = True
        events.append(CapacityEvent(when_ms / 1000, zone, count))
    return AvailabilityTrace(path.stem, {zone: initial}, tuple(events), span)


def scale(trace: AvailabilityTrace, nodes_at_peak: int) -> AvailabilityTrace:
    """Each zone's counts × nodes_at_peak / the trace's peak (rounded): the trace's shape for a
    fleet of another size (one node taken there is that many nodes taken here, at once)."""
    peak = max([*trace.initial.values(), *(e.capacity for e in trace.events)], default=1)
    factor = nodes_at_peak / max(1, peak)
    return AvailabilityTrace(
        f"{trace.name}×{factor:g}",
        {z: round(c * factor) for z, c in trace.initial.items()},
        tuple(
            CapacityEvent(e.time_seconds, e.zone, round(e.capacity * factor)) for e in trace.events
        ),
        trace.span_seconds,
    )


def tile(trace: AvailabilityTrace, until_seconds: float) -> AvailabilityTrace:
    """The trace repeated back to back until ``until_seconds``; each repeat starts from the
    initial counts again."""
    if trace.span_seconds <= 0:
        raise ValueError("a trace to tile needs a positive span")
    events: list[CapacityEvent] = []
    repeats = math.ceil(until_seconds / trace.span_seconds)
    for k in range(repeats):
        offset = k * trace.span_seconds
        if k:
            events.extend(CapacityEvent(offset, z, c) for z, c in trace.initial.items())
        events.extend(
            CapacityEvent(e.time_seconds + offset, e.zone, e.capacity)
            for e in trace.events
            if e.time_seconds + offset < until_seconds
        )
    return AvailabilityTrace(
        f"{trace.name} tiled", dict(trace.initial), tuple(events), until_seconds
    )


@dataclass(frozen=True)
class WaveSpec:
    zones: int = 3
    capacity_per_zone: int = 60  # spot nodes a zone holds when no wave is on
    waves_per_zone_per_day: float = 2.0  # assumption (see the module doc)
    depth: tuple[float, float] = (0.3, 0.8)  # share of the zone's capacity a wave takes
    cluster_seconds: float = WAVE_CLUSTER_SECONDS
    outage_seconds_mean: float = 1800.0  # until the capacity comes back (assumption)
    span_seconds: float = 86400.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.zones < 1 or self.capacity_per_zone < 0:
            raise ValueError("zones must be ≥ 1 and capacity ≥ 0")
        low, high = self.depth
        if not 0 <= low <= high <= 1:
            raise ValueError("depth must be 0 ≤ low ≤ high ≤ 1")


def waves(spec: WaveSpec) -> AvailabilityTrace:
    """Correlated waves: per zone, Poisson wave starts; each wave takes a share of the zone's
    capacity one node at a time, spread over ``cluster_seconds``; it all comes back after an
    exponential outage."""
    rng = np.random.default_rng(spec.seed)
    names = tuple(chr(ord("a") + i) for i in range(spec.zones))
    changes: list[tuple[float, str, int]] = []  # (time, zone, delta)
    rate = spec.waves_per_zone_per_day / 86400.0
    for zone in names:
        t = 0.0
        while rate > 0:
            t += rng.exponential(1 / rate)
            if t >= spec.span_seconds:
                break
            taken = round(rng.uniform(*spec.depth) * spec.capacity_per_zone)
            offsets = np.sort(rng.uniform(0, spec.cluster_seconds, size=taken))
            changes.extend((t + float(o), zone, -1) for o in offsets)
            back = t + spec.cluster_seconds + rng.exponential(spec.outage_seconds_mean)
            changes.append((back, zone, taken))
            t = back  # the next wave in this zone after the capacity came back
    changes.sort()
    level = {z: spec.capacity_per_zone for z in names}
    events = []
    for when, zone, delta in changes:
        if when >= spec.span_seconds:
            continue
        level[zone] += delta
        events.append(CapacityEvent(when, zone, level[zone]))
    return AvailabilityTrace(
        f"waves({spec.zones} zones, {spec.waves_per_zone_per_day:g}/zone/day)",
        {z: spec.capacity_per_zone for z in names},
        tuple(events),
        spec.span_seconds,
    )
