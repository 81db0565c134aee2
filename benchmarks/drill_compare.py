"""spotinfer vs reroute under the same preemptions (issue #5): a `rolling` drill and a `trace`
drill (SpotServe's A_S availability trace, time-scaled), each run once per failover policy on
the same arrivals, and what the clients saw.

    python -m benchmarks.drill_compare [--model smollm2-135m] [--scenarios rolling,trace]
        [--rate 0.5] [--output-tokens 96,160] [--rolling-duration 300] [--rolling-interval 30]
        [--trace ../shared/traces/spotserve/As.jsonl] [--trace-time-scale 0.1]
        [--slo-seconds auto] [--json docs/bench/drill_compare.json]
        [--plot docs/bench/drill_compare.png]

    per scenario:  plan (seeded) ──▶ cluster(policy=spotinfer) ─ run_drill ─▶ report, traces
                                 └─▶ cluster(policy=reroute)   ─ run_drill ─▶ report, traces
                   same request ids, prompts, output lengths, arrival offsets, disturbance
                   offsets (rolling: from --rolling-first; trace: the trace's times × scale)

The policies (`spotinfer drill --policy`): ``spotinfer`` moves a noticed request with its KV
(nothing recomputed); ``reroute`` restarts it from its prompt on another worker (the
client-retry baseline of other stacks; it recomputes the prompt and every token delivered).

Each run is a whole local cluster (its own redis-server, coordinator, workers with daemons
and metadata servers) driven by `spotinfer.drills.runner.run_drill`, which also checks every
invariant (lost, duplicates, gaps, fidelity, leaks; recomputed tokens = 0 after a notice for
the spotinfer policy). Per run:

- P50 / P99 end-to-end latency: first send → last token, as the client saw it (a refused or
  broken request's retries count in its latency);
- goodput: requests that completed with e2e ≤ the SLO, per second of the run (first request
  sent → last token). The SLO is ``--slo-seconds``, or by default (``auto``) twice the median
  e2e latency of the requests that no disturbance touched, pooled over both policies' runs of
  the scenario — the same bar for both, set by what an undisturbed request costs here;
- recomputed tokens (MIGRATED and RECOVERED events), preemptions, the invariant verdict;
- per scenario: reroute / spotinfer for P50 and P99.

SpotServe reported P99 2.4–9.1× lower than re-routing on this trace, on GPUs with 6.7–20B
models; here the model is 135M on two CPU cores, where a recompute costs far less.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    benchmark_parser,
    percentile,
    plot_figure,
    resolve_model_arg,
    write_json,
)
from spotinfer.drills.report import goodput_rps
from spotinfer.drills.runner import DrillOptions, plan, run_drill
from spotinfer.drills.scenarios import trace_span_seconds
from spotinfer.loadgen import RequestTrace
from spotinfer.local.cluster import ClusterConfig, LocalCluster

POLICIES = ("spotinfer", "reroute")
SCENARIOS = ("rolling", "trace")
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "spotserve" / "As.jsonl"
SLO_FACTOR = 2.0  # auto SLO: this × the median e2e of undisturbed requests
DISTURBED_EVENTS = frozenset({"notice", "migrated", "recovered", "resumed"})


@dataclass(frozen=True)
class ScenarioSetup:
    """One scenario as both policies run it: the same drill options and cluster shape."""

    options: DrillOptions
    workers: int
    standbys: int
    note: str


@dataclass
class PolicyRun:
    scenario: str
    policy: str
    wall_seconds: float = 0.0
    report: dict[str, Any] = field(default_factory=dict)
    e2e_seconds: list[float | None] = field(default_factory=list)  # per request, plan order
    disturbed: list[bool] = field(default_factory=list)  # per request
    cluster_events: list[dict[str, Any]] = field(default_factory=list)
    goodput_rps: float = 0.0
    error: str = ""
    traces: list[RequestTrace] = field(default_factory=list, repr=False)

    @property
    def verdict(self) -> str:
        return "ERROR" if self.error else str(self.report.get("verdict", "?"))

    def summary(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "policy": self.policy,
            "verdict": self.verdict,
            "error": self.error,
            "wall_seconds": round(self.wall_seconds, 1),
            "requests": self.report.get("requests", 0),
            "completed": sum(1 for e in self.e2e_seconds if e is not None),
            "preemptions": self.report.get("preemptions", 0),
            "p50_e2e_seconds": self.report.get("p50_ms", 0.0) / 1000,
            "p99_e2e_seconds": self.report.get("p99_ms", 0.0) / 1000,
            "goodput_rps": self.goodput_rps,
            "recomputed_tokens": self.report.get("recomputed_tokens", 0),
            "migrations": self.report.get("migrations", 0),
            "recoveries": self.report.get("recoveries", 0),
        }


def scenario_setups(args: argparse.Namespace) -> list[ScenarioSetup]:
    low, high = (int(v) for v in args.output_tokens.split(","))
    common = DrillOptions(
        scenario="",
        rate_per_second=args.rate,
        output_tokens=(low, high),
        seed=args.seed,
    )
    setups = []
    for name in args.scenarios.split(","):
        if name == "rolling":
            # Arrivals until two intervals after the last notice (Poisson arrivals may end
            # early): every notice hits requests mid-stream. The grace is a fixed length, not
            # the cloud's 2 minutes: a node lingering 120 s after each 30 s notice would only
            # crowd the two cores.
            span = args.rolling_first + args.rolling_duration + args.rolling_interval
            options = replace(
                common,
                scenario="rolling",
                requests=math.ceil(args.rate * span),
                grace_seconds=args.rolling_grace,
                interval_seconds=args.rolling_interval,
                duration_seconds=args.rolling_duration,
                first_disturbance_seconds=args.rolling_first,
            )
            note = (
                f"a notice (AWS format, {args.rolling_grace:g} s grace) every "
                f"{args.rolling_interval:g} s for {args.rolling_duration:g} s from "
                f"{args.rolling_first:g} s on; 1 active worker, {args.rolling_standbys} "
                "standbys, each lost node replaced by a booting standby"
            )
            # A replacement must be warm before it is needed: with k standbys it has
            # k × interval - boot seconds (a SmolLM2 worker boots in 40-60 s on a busy box).
            setups.append(
                ScenarioSetup(options, workers=1, standbys=args.rolling_standbys, note=note)
            )
        elif name == "trace":
            span = trace_span_seconds(args.trace) * args.trace_time_scale
            options = replace(
                common,
                scenario="trace",
                requests=math.ceil(args.rate * span),
                time_scale=args.trace_time_scale,
                trace_file=args.trace,
            )
            note = (
                f"{args.trace.name} at ×{args.trace_time_scale:g} ({span:.0f} s), AWS grace "
                f"120 s × {args.trace_time_scale:g}; removals are notices, adds boot standbys"
            )
            setups.append(ScenarioSetup(options, workers=2, standbys=2, note=note))
    return setups


def run_policy(
    setup: ScenarioSetup,
    policy: str,
    args: argparse.Namespace,
    say: Callable[[str], None],
    on_done: Callable[[RequestTrace], None],
) -> PolicyRun:
    """One drill on a fresh cluster; an error is kept in the result, the others still run."""
    options = setup.options
    run = PolicyRun(options.scenario, policy)
    config = ClusterConfig(
        model=args.model_path,
        workers=setup.workers,
        standbys=setup.standbys,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        memory_gib=args.memory_gib,
        policy=policy,
        coordinator_flags=("--record-retention-seconds", "1"),
        log_dir=args.log_dir / f"{options.scenario}-{policy}",
    )
    vocab = int(json.loads(Path(args.model_path, "config.json").read_text())["vocab_size"])
    planned = plan(options, vocab, prefix=f"cmp-{options.scenario}")
    started = time.monotonic()
    try:
        say("starting the cluster")
        with LocalCluster(config, say) as cluster:
            outcome = run_drill(cluster, options, planned, say=say, on_done=on_done)
            run.cluster_events = [
                {"time": e.time, "kind": e.kind, "target": e.target, "detail": e.detail}
                for e in cluster.events
            ]
    except Exception as exc:  # one failed run must not lose the others' figures
        run.error = f"{type(exc).__name__}: {exc}"
        say(f"[red]{options.scenario}/{policy} failed[/]: {run.error}")
        return run
    finally:
        run.wall_seconds = time.monotonic() - started
    run.report = outcome.report.as_dict()
    by_id = {t.request_id: t for t in outcome.traces}
    ordered = [by_id[p.request_id] for p in planned if p.request_id in by_id]
    run.traces = ordered
    run.e2e_seconds = [t.e2e_seconds if t.ok and t.finish_reason else None for t in ordered]
    run.disturbed = [_disturbed(t) for t in ordered]
    start = min((t.sent_at for t in ordered), default=0.0)
    for event in run.cluster_events:
        event["time"] = round(event["time"] - start, 3)  # seconds since the first request
    return run


def _disturbed(trace: RequestTrace) -> bool:
    return (
        any(e.kind in DISTURBED_EVENTS for e in trace.events)
        or trace.reattached > 0
        or trace.resubmitted > 0
    )


def auto_slo_seconds(runs: Sequence[PolicyRun]) -> float:
    """SLO_FACTOR × the median e2e of the requests no disturbance touched, over `runs`."""
    calm = [
        e
        for run in runs
        for e, touched in zip(run.e2e_seconds, run.disturbed, strict=True)
        if e is not None and not touched
    ]
    if not calm:  # every request was touched: the median of all of them
        calm = [e for run in runs for e in run.e2e_seconds if e is not None]
    return SLO_FACTOR * statistics.median(calm) if calm else math.inf


def ratios(runs: Sequence[PolicyRun]) -> dict[str, float | None]:
    by_policy = {r.policy: r.summary() for r in runs if not r.error}
    if not {"spotinfer", "reroute"} <= by_policy.keys():
        return {}
    ours, theirs = by_policy["spotinfer"], by_policy["reroute"]

    def ratio(key: str) -> float | None:
        return theirs[key] / ours[key] if ours[key] else None

    return {
        "p50_reroute_over_spotinfer": ratio("p50_e2e_seconds"),
        "p99_reroute_over_spotinfer": ratio("p99_e2e_seconds"),
        "goodput_spotinfer_over_reroute": (
            ours["goodput_rps"] / theirs["goodput_rps"] if theirs["goodput_rps"] else None
        ),
    }


def markdown_table(result: dict[str, Any]) -> str:
    lines = [
        "| scenario | policy | requests | preemptions | P50 e2e (s) | P99 e2e (s) "
        "| goodput (req/s ≤ SLO) | recomputed tokens | invariants |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario in result["scenarios"]:
        for run in scenario["runs"]:
            lines.append(
                f"| {run['scenario']} | {run['policy']} | {run['requests']} "
                f"| {run['preemptions']} | {run['p50_e2e_seconds']:.2f} "
                f"| {run['p99_e2e_seconds']:.2f} | {run['goodput_rps']:.3f} "
                f"| {run['recomputed_tokens']} | {run['verdict']} |"
            )
    lines += [
        "",
        "| scenario | SLO e2e (s) | P50 reroute / spotinfer | P99 reroute / spotinfer "
        "| goodput spotinfer / reroute |",
        "|---|---|---|---|---|",
    ]
    for scenario in result["scenarios"]:
        r = scenario["ratios"]
        lines.append(
            f"| {scenario['scenario']} | {scenario['slo_seconds']:.2f} "
            f"| {_fmt(r.get('p50_reroute_over_spotinfer'))} "
            f"| {_fmt(r.get('p99_reroute_over_spotinfer'))} "
            f"| {_fmt(r.get('goodput_spotinfer_over_reroute'))} |"
        )
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def plot(result: dict[str, Any], runs: dict[str, list[PolicyRun]], path: Path) -> None:
    """Per scenario, the e2e latency CDF of each policy, with the SLO and P99 marked."""
    scenarios = result["scenarios"]
    with plot_figure(path, columns=len(scenarios), size_inches=(6, 4.2)) as (figure, axes):
        colours = {"spotinfer": "tab:blue", "reroute": "tab:red"}
        for axis, scenario in zip(axes, scenarios, strict=True):
            for run in runs[scenario["scenario"]]:
                e2e = sorted(e for e in run.e2e_seconds if e is not None)
                if not e2e:
                    continue
                share = [(i + 1) / len(run.e2e_seconds) for i in range(len(e2e))]
                colour = colours.get(run.policy, "tab:gray")
                axis.step(e2e, share, where="post", color=colour, label=f"{run.policy}")
                p99 = percentile(e2e, 0.99)
                axis.axvline(p99, color=colour, ls=":", lw=1)
                axis.annotate(
                    f"P99 {p99:.1f} s", (p99, 0.45), rotation=90, fontsize=7, color=colour
                )
            if math.isfinite(scenario["slo_seconds"]):
                axis.axvline(scenario["slo_seconds"], color="black", ls="--", lw=1, label="SLO")
            ratio = scenario["ratios"].get("p99_reroute_over_spotinfer")
            axis.set_title(
                f"{scenario['scenario']}: P99 reroute/spotinfer {_fmt(ratio)}", fontsize=10
            )
            axis.set_xlabel("end-to-end latency (s)")
            axis.set_ylabel("share of requests completed")
            axis.set_ylim(0, 1.02)
            axis.grid(True, alpha=0.3)
            axis.legend(fontsize=8, loc="lower right")
        figure.suptitle(f"Preemption drills, {Path(result['model']).name} on CPU", fontsize=11)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__, plot=True)
    parser.add_argument("--scenarios", default="rolling,trace")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--rate", type=float, default=0.5, help="requests/s (Poisson)")
    parser.add_argument("--output-tokens", default="96,160", help="range low,high")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rolling-duration", type=float, default=300.0, help="seconds")
    parser.add_argument("--rolling-interval", type=float, default=30.0, help="seconds")
    parser.add_argument("--rolling-first", type=float, default=15.0, help="first notice, s")
    parser.add_argument("--rolling-grace", type=float, default=30.0, help="seconds")
    parser.add_argument("--rolling-standbys", type=int, default=3, help="warm at the start")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--trace-time-scale", type=float, default=0.1)
    parser.add_argument("--slo-seconds", default="auto", help="e2e SLO in seconds, or auto")
    parser.add_argument("--dtype", default="float32", help="float32: fidelity is checked")
    # Prompts ≤ 96 + outputs ≤ 160 tokens: 512 leaves the KV for ~30 sequences per worker
    # (at 2048 and 1 GiB, float32 SmolLM2 gets max_num_seqs 4 and everything queues).
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--memory-gib", type=float, default=1.5, help="per worker")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/drill-compare"))
    args = parser.parse_args(argv)
    if args.rate <= 0:
        parser.error("--rate must be positive")
    for flag, given, known in (
        ("--scenarios", args.scenarios, SCENARIOS),
        ("--policies", args.policies, POLICIES),
    ):
        if not set(given.split(",")) <= set(known):
            parser.error(f"{flag} {given}: pick from {','.join(known)}")
    if "trace" in args.scenarios.split(",") and not args.trace.exists():
        parser.error(f"--trace {args.trace}: no such file")
    try:
        low, high = (int(v) for v in args.output_tokens.split(","))
    except ValueError:
        parser.error(f"--output-tokens must be low,high, got {args.output_tokens!r}")
    longest = DrillOptions(scenario="").prompt_tokens[1] + high
    if not 1 <= low <= high or args.max_model_len < longest:
        parser.error(f"--output-tokens {low},{high} needs --max-model-len >= {longest}")
    if args.slo_seconds != "auto":
        try:
            float(args.slo_seconds)
        except ValueError:
            parser.error("--slo-seconds must be a number of seconds or auto")
    args.model_path = resolve_model_arg(args.model)
    if not Path(args.model_path, "config.json").exists():
        parser.error(f"--model {args.model}: no config.json in {args.model_path}")
    return args


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    args = parse_args(argv)
    setups = scenario_setups(args)
    policies = args.policies.split(",")
    console = Console()
    runs: dict[str, list[PolicyRun]] = {s.options.scenario: [] for s in setups}
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        "{task.fields[phase]}",
        console=console,
    ) as progress:
        tasks = {
            (s.options.scenario, p): progress.add_task(
                f"{s.options.scenario}/{p}", total=s.options.requests, phase="waiting", start=False
            )
            for s in setups
            for p in policies
        }
        for setup in setups:
            for policy in policies:
                task = tasks[(setup.options.scenario, policy)]
                progress.start_task(task)

                def say(
                    message: str, task: Any = task, name: str = f"{setup.options.scenario}/{policy}"
                ) -> None:
                    progress.update(task, phase=message[:60])
                    progress.console.print(f"[dim]{time.strftime('%H:%M:%S')} {name}[/] {message}")

                def done(_: RequestTrace, task: Any = task) -> None:
                    progress.advance(task)

                run = run_policy(setup, policy, args, say, done)
                progress.update(task, phase=f"{run.verdict} in {run.wall_seconds:.0f} s")
                progress.stop_task(task)
                runs[setup.options.scenario].append(run)
    result = summarize(args, setups, runs)
    table = markdown_table(result)
    print(table)
    if args.json:
        write_json(args.json, result, indent=1)
        console.print(f"JSON: {args.json}")
    if args.plot:
        plot(result, runs, args.plot)
        console.print(f"plot: {args.plot}")
    return 0 if all(r.verdict == "PASS" for rs in runs.values() for r in rs) else 1


def summarize(
    args: argparse.Namespace, setups: Sequence[ScenarioSetup], runs: dict[str, list[PolicyRun]]
) -> dict[str, Any]:
    scenarios = []
    for setup in setups:
        name = setup.options.scenario
        mine = runs[name]
        if args.slo_seconds == "auto":
            slo = auto_slo_seconds([r for r in mine if not r.error])
            slo_rule = (
                f"{SLO_FACTOR:g} × the median e2e of undisturbed requests, both policies pooled"
            )
        else:
            slo, slo_rule = float(args.slo_seconds), "--slo-seconds"
        for run in mine:
            run.goodput_rps = goodput_rps(run.traces, slo * 1000) if run.traces else 0.0
        options = {
            k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(setup.options).items()
        }
        scenarios.append(
            {
                "scenario": name,
                "setup": setup.note,
                "cluster": {"workers": setup.workers, "standbys": setup.standbys},
                "options": options,
                "slo_seconds": slo,
                "slo_rule": slo_rule,
                "runs": [r.summary() for r in mine],
                "ratios": ratios(mine),
                "detail": [
                    {
                        "policy": r.policy,
                        "report": r.report,
                        "e2e_seconds": r.e2e_seconds,
                        "disturbed": r.disturbed,
                        "cluster_events": r.cluster_events,
                    }
                    for r in mine
                ],
            }
        )
    return {
        "model": args.model_path,
        "dtype": args.dtype,
        "command": "python -m benchmarks.drill_compare " + " ".join(sys.argv[1:]),
        "goodput_rule": "requests completed with e2e ≤ SLO, per second from the first "
        "request sent to the last token",
        "scenarios": scenarios,
    }


if __name__ == "__main__":
    raise SystemExit(main())
