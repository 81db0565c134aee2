"""What a run comes to: cost per million output tokens, SLA attainment per class, latency
percentiles, recomputed tokens, on-demand node-hours — as a rich table, JSON and a plot."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common.requests import SlaClass
from spotinfer.simulator.arrivals import SimRequest, Slo
from spotinfer.simulator.costs import InstancePrice
from spotinfer.simulator.node import Market
from spotinfer.simulator.simulation import Simulation

# `spotinfer tune`'s interactive targets (TTFT p99 ≤ 2 s, TPOT p99 ≤ 150 ms); batch: an
# assumption (a bulk job that starts within 10 minutes and streams at ≥ 1 token/s).
DEFAULT_SLOS = {
    SlaClass.INTERACTIVE: Slo(ttft_seconds=2.0, tpot_seconds=0.150),
    SlaClass.BATCH: Slo(ttft_seconds=600.0, tpot_seconds=1.0),
}


@dataclass
class RunSummary:
    scenario: str
    policy: str
    calibration: str
    trace: str
    instance_type: str
    nodes: int
    standbys: int
    requests: int  # real requests (cohorts × weight)
    completed: int
    rejected: int
    output_tokens: int
    cost_usd: float
    cost_per_million_tokens: float
    spot_node_hours: float
    on_demand_node_hours: float
    p50_e2e_seconds: float
    p99_e2e_seconds: float
    p50_ttft_seconds: float
    p99_ttft_seconds: float
    sla_attainment: dict[str, float]
    recomputed_tokens: int
    migrations: int
    restarts: int
    recoveries: int
    notices: int
    simulated_seconds: float
    wall_seconds: float
    events: int
    slos: dict[str, dict[str, float]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def weighted_percentile(pairs: Sequence[tuple[float, int]], q: float) -> float:
    """Nearest rank over (value, weight) pairs: the smallest value with at least q of the
    weight at or below it (the drills' percentile when every weight is 1)."""
    if not pairs:
        return math.nan
    ordered = sorted(pairs)
    total = sum(w for _, w in ordered)
    need = q * total
    running = 0
    for value, weight in ordered:
        running += weight
        if running >= need - 1e-9:
            return value
    return ordered[-1][0]


def summarize(
    sim: Simulation,
    price: InstancePrice,
    scenario: str,
    slos: dict[SlaClass, Slo] | None = None,
    wall_seconds: float = 0.0,
) -> RunSummary:
    slos = slos or DEFAULT_SLOS
    requests: list[SimRequest] = sim.requests
    done = [r for r in requests if r.finished_at is not None]
    e2e = [(r.finished_at - r.arrival, r.weight) for r in done if r.finished_at is not None]
    ttft = [(r.first_token_at - r.arrival, r.weight) for r in done if r.first_token_at is not None]
    tokens = sum(r.output_tokens * r.weight for r in done)
    end = sim.end_seconds
    cost = 0.0
    hours = {Market.SPOT: 0.0, Market.ON_DEMAND: 0.0}
    for node in sim.fleet.nodes:
        stop = node.gone_at if node.gone_at is not None else end
        node_hours = max(0.0, min(stop, end) - node.launched_at) / 3600
        hours[node.market] += node_hours
        cost += node_hours * price.usd_per_hour(node.market)
    attainment = {}
    for sla in SlaClass:
        of_class = [r for r in requests if r.sla_class == sla]
        if of_class:
            met = sum(r.weight for r in of_class if slos[sla].met_by(r))
            attainment[sla.name.lower()] = met / sum(r.weight for r in of_class)
    return RunSummary(
        scenario=scenario,
        policy=sim.policy.name,
        calibration=sim.calibration.name,
        trace=sim.trace.name,
        instance_type=price.instance_type,
        nodes=sim.config.fleet.nodes,
        standbys=sim.config.fleet.standbys,
        requests=sum(r.weight for r in requests),
        completed=sum(r.weight for r in done),
        rejected=sum(r.weight for r in requests if r.rejected),
        output_tokens=tokens,
        cost_usd=cost,
        cost_per_million_tokens=cost / (tokens / 1e6) if tokens else math.inf,
        spot_node_hours=hours[Market.SPOT],
        on_demand_node_hours=hours[Market.ON_DEMAND],
        p50_e2e_seconds=weighted_percentile(e2e, 0.5),
        p99_e2e_seconds=weighted_percentile(e2e, 0.99),
        p50_ttft_seconds=weighted_percentile(ttft, 0.5),
        p99_ttft_seconds=weighted_percentile(ttft, 0.99),
        sla_attainment=attainment,
        recomputed_tokens=sum(r.recomputed_tokens for r in requests),
        migrations=sum(r.migrations * r.weight for r in requests),
        restarts=sum(r.restarts * r.weight for r in requests),
        recoveries=sum(r.recoveries * r.weight for r in requests),
        notices=sim.counters.notices + sim.counters.kills,
        simulated_seconds=end,
        wall_seconds=wall_seconds,
        events=sim.clock.processed,
        slos={s.name.lower(): asdict(slo) for s, slo in slos.items()},
    )


def table(summaries: Sequence[RunSummary], title: str = "fleet simulation") -> Any:
    from rich.table import Table

    grid = Table(title=title)
    for column in (
        "scenario",
        "policy",
        "$ / 1M tok",
        "SLA inter.",
        "SLA batch",
        "P50 e2e",
        "P99 e2e",
        "recomputed",
        "od node-h",
        "spot node-h",
        "notices",
        "wall",
    ):
        grid.add_column(column, justify="left" if column in ("scenario", "policy") else "right")
    for s in summaries:
        grid.add_row(
            s.scenario,
            s.policy,
            f"{s.cost_per_million_tokens:.3f}",
            _percent(s.sla_attainment.get("interactive")),
            _percent(s.sla_attainment.get("batch")),
            f"{s.p50_e2e_seconds:.2f} s",
            f"{s.p99_e2e_seconds:.2f} s",
            f"{s.recomputed_tokens:,}",
            f"{s.on_demand_node_hours:,.1f}",
            f"{s.spot_node_hours:,.1f}",
            str(s.notices),
            f"{s.wall_seconds:.1f} s",
        )
    return grid


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def write_json(summaries: Sequence[RunSummary], path: Path, meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {**meta, "runs": [s.as_dict() for s in summaries]}
    path.write_text(json.dumps(body, indent=2, default=str) + "\n")


def plot(summaries: Sequence[RunSummary], path: Path, title: str = "") -> None:
    """Per scenario: cost per 1M tokens and interactive SLA attainment, one bar per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(s.scenario for s in summaries))
    policies = list(dict.fromkeys(s.policy for s in summaries))
    by_key = {(s.scenario, s.policy): s for s in summaries}
    figure, (cost_axis, sla_axis) = plt.subplots(
        1, 2, figsize=(max(8, 2.2 * len(scenarios) + 4), 4.2)
    )
    width = 0.8 / max(1, len(policies))
    for i, policy in enumerate(policies):
        xs = [k + i * width for k in range(len(scenarios))]
        costs = [_value(by_key.get((sc, policy)), "cost") for sc in scenarios]
        slas = [_value(by_key.get((sc, policy)), "sla") for sc in scenarios]
        cost_axis.bar(xs, costs, width, label=policy)
        sla_axis.bar(xs, slas, width, label=policy)
    for axis, label in (
        (cost_axis, "$ per 1M output tokens"),
        (sla_axis, "interactive SLA met (%)"),
    ):
        axis.set_xticks([k + 0.4 - width / 2 for k in range(len(scenarios))])
        axis.set_xticklabels(scenarios, rotation=15, fontsize=8)
        axis.set_ylabel(label)
    sla_axis.set_ylim(0, 105)
    cost_axis.legend(fontsize=8)
    if title:
        figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _value(summary: RunSummary | None, what: str) -> float:
    if summary is None:
        return 0.0
    if what == "cost":
        return (
            summary.cost_per_million_tokens
            if math.isfinite(summary.cost_per_million_tokens)
            else 0.0
        )
    return 100 * summary.sla_attainment.get("interactive", 0.0)
