"""A local drill replayed in the simulator: the drill's own planned load (the load generator,
the same seed) and its cluster events as the drill recorded them (`drill_compare.json`), so
that the simulator's prediction can be held against what the drill measured.

    drill_compare.json ─ options ─▶ spotinfer.drills.runner.plan ─▶ the same 173 requests
                      └ cluster_events (notice / join, per policy) ─▶ ClusterAction script
                      └ cluster shape (workers, standbys) ─▶ initial nodes
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotinfer.drills.runner import DrillOptions, plan
from spotinfer.loadgen import percentile
from spotinfer.simulator.arrivals import SimRequest, from_planned
from spotinfer.simulator.calibration import Calibration
from spotinfer.simulator.fleet import FleetSpec
from spotinfer.simulator.node import NodeState
from spotinfer.simulator.policies import Policy
from spotinfer.simulator.simulation import ClusterAction, InitialNode, SimConfig, Simulation
from spotinfer.simulator.traces import unlimited

# The drill's model (SmolLM2-135M): its vocabulary bounds the seeded prompt ids, and so
# shapes the random stream the output lengths are drawn from after them.
SMOLLM2_VOCAB_SIZE = 49152
POLICY_OF_DRILL = {"spotinfer": "spotinfer", "reroute": "reroute"}


@dataclass(frozen=True)
class DrillRun:
    scenario: str
    policy: str
    measured_p50_seconds: float
    measured_p99_seconds: float
    actions: tuple[ClusterAction, ...]
    initial: tuple[InitialNode, ...]
    options: DrillOptions
    grace_seconds: float
    measured_e2e_seconds: tuple[float | None, ...] = ()  # per request, plan order


@dataclass(frozen=True)
class Prediction:
    run: DrillRun
    p50_seconds: float
    p99_seconds: float
    recomputed_tokens: int
    migrations: int
    restarts: int
    # measured / predicted e2e, medians: requests that ran while a replacement booted on the
    # drill's machine (a join less than boot_seconds before their end) and the others
    ratio_during_boots: float = float("nan")
    ratio_otherwise: float = float("nan")

    @property
    def p50_residual(self) -> float:
        return self.p50_seconds / self.run.measured_p50_seconds - 1

    @property
    def p99_residual(self) -> float:
        return self.p99_seconds / self.run.measured_p99_seconds - 1


def load_runs(path: Path, scenario: str = "rolling") -> list[DrillRun]:
    data = json.loads(path.read_text())
    entry = next(s for s in data["scenarios"] if s["scenario"] == scenario)
    options = _options(entry["options"])
    grace = (options.grace_seconds or 0.0) * options.time_scale
    workers, standbys = entry["cluster"]["workers"], entry["cluster"]["standbys"]
    initial = tuple(
        InitialNode(f"node-{i}", NodeState.ACTIVE if i < workers else NodeState.STANDBY)
        for i in range(workers + standbys)
    )
    measured = {r["policy"]: r for r in entry["runs"] if not r.get("error")}
    runs = []
    for detail in entry["detail"]:
        policy = detail["policy"]
        if policy not in measured:
            continue
        actions = tuple(
            ClusterAction(float(e["time"]), e["kind"], e["target"], grace)
            for e in detail["cluster_events"]
            if e["kind"] in ("notice", "join", "kill")
        )
        runs.append(
            DrillRun(
                scenario=scenario,
                policy=policy,
                measured_p50_seconds=float(measured[policy]["p50_e2e_seconds"]),
                measured_p99_seconds=float(measured[policy]["p99_e2e_seconds"]),
                actions=actions,
                initial=initial,
                options=options,
                grace_seconds=grace,
                measured_e2e_seconds=tuple(detail.get("e2e_seconds", ())),
            )
        )
    return runs


def _options(raw: dict[str, Any]) -> DrillOptions:
    return DrillOptions(
        scenario=str(raw["scenario"]),
        requests=int(raw["requests"]),
        rate_per_second=float(raw["rate_per_second"]),
        prompt_tokens=(int(raw["prompt_tokens"][0]), int(raw["prompt_tokens"][1])),
        output_tokens=(int(raw["output_tokens"][0]), int(raw["output_tokens"][1])),
        time_scale=float(raw["time_scale"]),
        grace_seconds=raw["grace_seconds"],
        seed=int(raw["seed"]),
        block_tokens=int(raw["block_tokens"]),
    )


def replay(run: DrillRun, calibration: Calibration) -> tuple[Prediction, Simulation]:
    planned = plan(run.options, SMOLLM2_VOCAB_SIZE, prefix=f"cmp-{run.scenario}")
    requests = from_planned(planned)
    standbys = sum(1 for n in run.initial if n.state == NodeState.STANDBY)
    workers = len(run.initial) - standbys
    config = SimConfig(
        FleetSpec(workers, standbys, autoscale=False), grace_seconds=run.grace_seconds
    )
    span = max(r.arrival for r in requests)
    sim = Simulation(
        config,
        calibration,
        Policy.create(POLICY_OF_DRILL[run.policy]),
        requests,
        unlimited(("a",), span),
        script=run.actions,
        initial=run.initial,
    )
    sim.run()
    e2e = [r.e2e_seconds for r in requests if r.e2e_seconds is not None]
    during, otherwise = _ratios_by_boot(run, requests, calibration.boot_seconds)
    prediction = Prediction(
        ratio_during_boots=during,
        ratio_otherwise=otherwise,
        run=run,
        p50_seconds=percentile(e2e, 0.5),
        p99_seconds=percentile(e2e, 0.99),
        recomputed_tokens=sum(r.recomputed_tokens for r in requests),
        migrations=sum(r.migrations for r in requests),
        restarts=sum(r.restarts for r in requests),
    )
    return prediction, sim


def _ratios_by_boot(
    run: DrillRun, requests: list[SimRequest], boot_seconds: float
) -> tuple[float, float]:
    joins = [a.time_seconds for a in run.actions if a.kind == "join"]
    during: list[float] = []
    otherwise: list[float] = []
    for measured, request in zip(run.measured_e2e_seconds, requests, strict=False):
        if measured is None or request.e2e_seconds is None:
            continue
        end = request.arrival + measured
        booting = any(j < end and request.arrival < j + boot_seconds for j in joins)
        (during if booting else otherwise).append(measured / request.e2e_seconds)
    return _median(during), _median(otherwise)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
