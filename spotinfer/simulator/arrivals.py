"""The simulated requests and where they come from: Poisson or bursty arrivals, a request
trace (JSONL), or a drill's planned load (the same requests a drill sent).

A simulated request may stand for a cohort of ``weight`` identical requests sent together,
so that a day of a large fleet stays a few hundred thousand events: slots, batch sizes and
token counts count the weight; latencies are the cohort's.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from common.requests import SlaClass

if TYPE_CHECKING:
    from spotinfer.loadgen import PlannedRequest
    from spotinfer.simulator.fleet import Node


class Process(str, enum.Enum):
    POISSON = "poisson"
    BURSTY = "bursty"  # groups of burst_size at once, groups at rate / burst_size


@dataclass(frozen=True)
class Slo:
    """A request meets its class's SLO when it completes with TTFT ≤ ttft_seconds and mean
    time per output token (first token → last, interruptions included) ≤ tpot_seconds."""

    ttft_seconds: float
    tpot_seconds: float

    def met_by(self, request: SimRequest) -> bool:
        if request.finished_at is None or request.first_token_at is None:
            return False
        ttft = request.first_token_at - request.arrival
        if ttft > self.ttft_seconds:
            return False
        if request.output_tokens < 2:
            return True
        tpot = (request.finished_at - request.first_token_at) / (request.output_tokens - 1)
        return tpot <= self.tpot_seconds


class SimRequest:
    """One request (or cohort) as the simulation moves it; plain slots for speed."""

    __slots__ = (
        "request_id",
        "arrival",
        "prompt_tokens",
        "output_tokens",
        "sla_class",
        "weight",
        "first_token_at",
        "finished_at",
        "rejected",
        "node",
        "reserved_on",
        "start_v",
        "ready_at",
        "target_v",
        "have_tokens",
        "placement",
        "recomputed_tokens",
        "migrations",
        "restarts",
        "recoveries",
    )

    def __init__(
        self,
        request_id: str,
        arrival: float,
        prompt_tokens: int,
        output_tokens: int,
        sla_class: SlaClass = SlaClass.INTERACTIVE,
        weight: int = 1,
    ) -> None:
        if prompt_tokens < 1 or output_tokens < 1 or weight < 1:
            raise ValueError(f"request {request_id}: tokens and weight must be at least 1")
        self.request_id = request_id
        self.arrival = arrival
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.sla_class = sla_class
        self.weight = weight
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.rejected = False
        self.node: Node | None = None  # where it decodes now
        self.reserved_on: Node | None = None  # where it is moving to
        self.start_v = 0.0  # the node's step count when this request's decode began there
        self.ready_at = 0.0  # when its first new token there comes (its prefill's end)
        self.target_v = 0.0  # the node's step count at which it finishes
        self.have_tokens = 0  # output tokens in its context when it joined that node
        self.placement = 0  # bumped at every move: stale heap entries are skipped
        self.recomputed_tokens = 0
        self.migrations = 0
        self.restarts = 0
        self.recoveries = 0

    @property
    def e2e_seconds(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.arrival

    @property
    def ttft_seconds(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    def __repr__(self) -> str:
        return f"SimRequest({self.request_id}, t={self.arrival:.3f})"


@dataclass(frozen=True)
class ArrivalSpec:
    rate_per_second: float  # real requests per second
    duration_seconds: float
    process: Process = Process.POISSON
    burst_size: int = 8
    prompt_tokens: tuple[int, int] = (256, 2048)  # inclusive, uniform
    output_tokens: tuple[int, int] = (64, 512)
    batch_fraction: float = 0.0
    weight: int = 1  # real requests per simulated cohort
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate_per_second <= 0 or self.duration_seconds <= 0:
            raise ValueError("rate and duration must be positive")
        if self.weight < 1 or self.burst_size < 1:
            raise ValueError("weight and burst_size must be at least 1")
        for name in ("prompt_tokens", "output_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range 1 <= low <= high")
        if not 0 <= self.batch_fraction <= 1:
            raise ValueError("batch_fraction must be in [0, 1]")


def generate(spec: ArrivalSpec) -> list[SimRequest]:
    """Seeded arrivals over [0, duration)."""
    rng = np.random.default_rng(spec.seed)
    cohort_rate = spec.rate_per_second / spec.weight
    group = spec.burst_size if spec.process == Process.BURSTY else 1
    expected = int(cohort_rate / group * spec.duration_seconds * 1.2) + 16
    gaps = rng.exponential(group / cohort_rate, size=expected)
    starts = np.cumsum(gaps) - gaps[0]
    while starts[-1] < spec.duration_seconds:  # rare: draw more
        more = rng.exponential(group / cohort_rate, size=expected)
        starts = np.concatenate([starts, starts[-1] + np.cumsum(more)])
    starts = starts[starts < spec.duration_seconds]
    times = np.repeat(starts, group)
    count = len(times)
    prompts = rng.integers(spec.prompt_tokens[0], spec.prompt_tokens[1] + 1, size=count)
    outputs = rng.integers(spec.output_tokens[0], spec.output_tokens[1] + 1, size=count)
    batch = rng.random(count) < spec.batch_fraction
    return [
        SimRequest(
            f"r{i}",
            float(times[i]),
            int(prompts[i]),
            int(outputs[i]),
            SlaClass.BATCH if batch[i] else SlaClass.INTERACTIVE,
            spec.weight,
        )
        for i in range(count)
    ]


def from_planned(planned: Sequence[PlannedRequest]) -> list[SimRequest]:
    """A drill's planned load (`spotinfer.loadgen.plan_requests`), request for request."""
    return [
        SimRequest(
            p.request_id,
            p.send_offset_seconds,
            len(p.prompt_token_ids),
            p.max_tokens,
            SlaClass(p.sla_class),
        )
        for p in planned
    ]


def read_trace(path: Path, weight: int = 1) -> list[SimRequest]:
    """A request trace: one JSON object per line with ``arrival_seconds``, ``prompt_tokens``,
    ``output_tokens`` and optionally ``sla_class`` ("interactive" / "batch")."""
    requests = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        sla = SlaClass[str(row.get("sla_class", "interactive")).upper()]
        requests.append(
            SimRequest(
                str(row.get("request_id", f"t{i}")),
                float(row["arrival_seconds"]),
                int(row["prompt_tokens"]),
                int(row["output_tokens"]),
                sla,
                weight,
            )
        )
    requests.sort(key=lambda r: r.arrival)
    return requests
