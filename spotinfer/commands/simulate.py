"""`spotinfer simulate`: cost and SLA attainment of a spot fleet under each policy, simulated
(`spotinfer.simulator`); `calibrate` writes a CPU calibration from this project's benchmark
JSONs; `validate` replays a local drill and compares with what it measured."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from common.errors import UserError

# A run simulates about this many cohorts (a day of a 100-node fleet is ~10^7 requests)...
TARGET_SIMULATED_REQUESTS = 1_500_000
# ...but a node's batch always holds at least this many cohorts.
MIN_COHORTS_PER_BATCH = 8
TRACE_IN_SHARED = Path("shared") / "traces" / "spotserve" / "As.jsonl"


def default_trace() -> Path:
    """SpotServe's A_S trace beside the checkout (the first ``shared/`` above it)."""
    for folder in Path(__file__).resolve().parents:
        if (folder / TRACE_IN_SHARED).exists():
            return folder / TRACE_IN_SHARED
    return Path("..") / TRACE_IN_SHARED


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate", help="simulate a spot fleet: cost per 1M tokens and SLA attainment per policy"
    )
    actions = parser.add_subparsers(dest="simulate_command", metavar="ACTION")
    _register_run(actions)
    _register_calibrate(actions)
    _register_validate(actions)

    def usage(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=usage)


def _register_run(actions: Any) -> None:
    run = actions.add_parser("run", help="run the policies over a fleet and a trace")
    run.add_argument("--calibration", default="llama3-8b-h100", help="NAME or FILE[:NAME]")
    run.add_argument("--instance-type", default="h100x1", help="a row of the cost table")
    run.add_argument("--costs", type=Path, default=None, help="cost table JSON")
    run.add_argument("--policies", default="spotinfer,reroute,on-demand,skyserve")
    run.add_argument("--nodes", type=int, default=100, help="serving nodes wanted")
    run.add_argument("--standbys", type=int, default=5)
    run.add_argument("--hours", type=float, default=24.0, help="arrivals for this long")
    run.add_argument(
        "--trace",
        default="waves",
        help="'waves' (generated), 'none', or a SpotServe-format file (scaled to the fleet, tiled)",
    )
    run.add_argument("--zones", type=int, default=3, help="zones (generated waves)")
    run.add_argument("--waves-per-zone-per-day", type=float, default=2.0)
    run.add_argument("--wave-depth", default="0.3,0.8", help="share of a zone taken, low,high")
    run.add_argument(
        "--outage-minutes", type=float, default=30.0, help="mean, until capacity returns"
    )
    run.add_argument(
        "--zone-headroom", type=float, default=0.2, help="capacity above an even spread"
    )
    run.add_argument(
        "--cloud", default="aws", choices=("aws", "gcp", "azure"), help="notice length"
    )
    run.add_argument("--grace-seconds", type=float, default=None, help="override the cloud's")
    run.add_argument(
        "--rate", type=float, default=None, help="requests/s (default: ~60%% of the fleet)"
    )
    run.add_argument("--utilization", type=float, default=0.6, help="load when --rate is not given")
    run.add_argument("--arrival", default="poisson", choices=("poisson", "bursty"))
    run.add_argument("--burst-size", type=int, default=8)
    run.add_argument("--request-trace", type=Path, default=None, help="JSONL of requests instead")
    run.add_argument("--prompt-tokens", default="512,4096")
    run.add_argument("--output-tokens", default="128,1024")
    run.add_argument("--batch-fraction", type=float, default=0.3, help="share of BATCH requests")
    run.add_argument(
        "--slo-interactive", default="2,0.15", help="TTFT,TPOT seconds (default: the tuner's)"
    )
    run.add_argument("--slo-batch", default="600,1", help="TTFT,TPOT seconds")
    run.add_argument(
        "--cohort", type=int, default=0, help="requests per simulated cohort (0: auto)"
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--scenario", default="", help="name in the report (default: the trace's)")
    run.add_argument("--json", type=Path, default=None)
    run.add_argument("--png", type=Path, default=None)
    run.set_defaults(func=run_command)


def _register_calibrate(actions: Any) -> None:
    cal = actions.add_parser("calibrate", help="a CPU calibration from benchmark JSONs")
    cal.add_argument("--from-bench", type=Path, default=Path("docs/bench"))
    cal.add_argument("--boot-seconds", type=float, default=None)
    cal.add_argument("--out", type=Path, required=True)
    cal.set_defaults(func=calibrate_command)


def _register_validate(actions: Any) -> None:
    val = actions.add_parser("validate", help="replay a drill and compare with its measurement")
    val.add_argument("--drill", type=Path, default=Path("docs/bench/drill_compare.json"))
    val.add_argument("--scenario", default="rolling")
    val.add_argument("--calibration", default="smollm2-135m-cpu", help="NAME or FILE[:NAME]")
    val.add_argument("--json", type=Path, default=None)
    val.set_defaults(func=validate_command)


def _pair(text: str, name: str) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in text.split(","))
    except ValueError as exc:
        raise UserError(f"--{name} must be two integers low,high, got {text!r}") from exc
    return low, high


def _calibration(name: str) -> Any:
    from spotinfer.simulator import calibration

    try:
        return calibration.find(name)
    except KeyError as exc:
        raise UserError(str(exc)) from exc


def capacity_rate(cal: Any, prompt: tuple[int, int], output: tuple[int, int]) -> float:
    """Requests/s one node serves at full batch, by the calibration (mean request)."""
    prompt_mean, output_mean = sum(prompt) / 2, sum(output) / 2
    batch = cal.max_num_seqs
    step = cal.step_seconds(batch, batch * (prompt_mean + output_mean / 2))
    node_seconds = output_mean * step / batch + cal.prefill_seconds(prompt_mean)
    return 1 / node_seconds


def run_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from common.requests import SlaClass
    from coordinator.constants import NOTICE_SECONDS_BY_CLOUD
    from spotinfer.simulator import arrivals, costs, report, traces
    from spotinfer.simulator.fleet import FleetSpec
    from spotinfer.simulator.policies import Policy
    from spotinfer.simulator.simulation import SimConfig, Simulation

    console = Console()
    cal = _calibration(args.calibration)
    table = costs.load(args.costs) if args.costs else costs.load()
    try:
        price = table.price(args.instance_type)
        policies = [Policy.create(name) for name in args.policies.split(",") if name]
    except (KeyError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    prompt, output = (
        _pair(args.prompt_tokens, "prompt-tokens"),
        _pair(args.output_tokens, "output-tokens"),
    )
    duration = args.hours * 3600
    rate = args.rate or args.utilization * args.nodes * capacity_rate(cal, prompt, output)
    cohort = args.cohort or min(
        max(1, cal.max_num_seqs // MIN_COHORTS_PER_BATCH),
        max(1, math.ceil(rate * duration / TARGET_SIMULATED_REQUESTS)),
    )
    if cohort > cal.max_num_seqs // MIN_COHORTS_PER_BATCH:
        console.print(
            f"[yellow]cohorts of {cohort} requests: fewer than "
            f"{MIN_COHORTS_PER_BATCH} per node's batch[/]"
        )
    trace = _trace(args, duration, traces)
    slos = {
        SlaClass.INTERACTIVE: _slo(args.slo_interactive, "slo-interactive", arrivals),
        SlaClass.BATCH: _slo(args.slo_batch, "slo-batch", arrivals),
    }
    grace = (
        args.grace_seconds
        if args.grace_seconds is not None
        else NOTICE_SECONDS_BY_CLOUD[args.cloud]
    )
    scenario = args.scenario or trace.name
    summaries = []
    for policy in policies:
        if args.request_trace is not None:
            requests = arrivals.read_trace(args.request_trace, cohort)
        else:
            spec = arrivals.ArrivalSpec(
                rate_per_second=rate,
                duration_seconds=duration,
                process=arrivals.Process(args.arrival),
                burst_size=args.burst_size,
                prompt_tokens=prompt,
                output_tokens=output,
                batch_fraction=args.batch_fraction,
                weight=cohort,
                seed=args.seed,
            )
            requests = arrivals.generate(spec)
        standbys = 0 if not policy.uses_spot else args.standbys
        config = SimConfig(FleetSpec(args.nodes, standbys), grace_seconds=grace, seed=args.seed)
        used_trace = (
            trace if policy.uses_spot else traces.unlimited(trace.zones, trace.span_seconds)
        )
        sim = Simulation(config, cal, policy, requests, used_trace)
        started = time.perf_counter()
        with Progress(
            TextColumn(f"{policy.name:<10}"),
            BarColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as progress:
            task = progress.add_task("", total=1.0)

            def tick(
                now: float, horizon: float, task: Any = task, progress: Any = progress
            ) -> None:
                progress.update(task, completed=now / horizon, description=f"{now / 3600:.1f} h")

            sim.run(tick)
        wall = time.perf_counter() - started
        summaries.append(report.summarize(sim, price, scenario, slos, wall_seconds=wall))
    console.print(report.table(summaries, title=f"{scenario} · {cal.name} · {args.nodes} nodes"))
    meta = {
        "command": "spotinfer simulate run " + " ".join(_argv(args)),
        "calibration": cal.to_json(),
        "price": price.__dict__,
        "trace": {
            "name": trace.name,
            "notices_if_all_held": trace.notices(),
            "span_seconds": trace.span_seconds,
        },
        "rate_per_second": rate,
        "cohort": cohort,
        "grace_seconds": grace,
    }
    if args.json:
        report.write_json(summaries, args.json, meta)
    if args.png:
        report.plot(summaries, args.png, title=f"{scenario} · {cal.name}")
    return 0


def _slo(text: str, name: str, arrivals: Any) -> Any:
    try:
        ttft, tpot = (float(v) for v in text.split(","))
    except ValueError as exc:
        raise UserError(f"--{name} must be TTFT,TPOT in seconds, got {text!r}") from exc
    return arrivals.Slo(ttft_seconds=ttft, tpot_seconds=tpot)


def _trace(args: argparse.Namespace, duration: float, traces: Any) -> Any:
    fleet = args.nodes + args.standbys
    if args.trace == "none":
        return traces.unlimited(tuple(chr(ord("a") + i) for i in range(args.zones)), duration)
    if args.trace == "waves":
        low, high = (float(v) for v in args.wave_depth.split(","))
        spec = traces.WaveSpec(
            zones=args.zones,
            capacity_per_zone=math.ceil(fleet / args.zones * (1 + args.zone_headroom)),
            waves_per_zone_per_day=args.waves_per_zone_per_day,
            depth=(low, high),
            outage_seconds_mean=args.outage_minutes * 60,
            span_seconds=duration,
            seed=args.seed,
        )
        return traces.waves(spec)
    path = Path(args.trace)
    if not path.exists():
        raise UserError(f"--trace {path}: no such file (or use 'waves' / 'none')")
    return traces.tile(traces.scale(traces.spotserve(path), fleet), duration)


def _argv(args: argparse.Namespace) -> list[str]:
    skip = {"func", "command", "simulate_command", "verbose"}
    out = []
    for key, value in vars(args).items():
        if key in skip or value is None or value is False:
            continue
        out.append(f"--{key.replace('_', '-')}" + ("" if value is True else f" {value}"))
    return out


def calibrate_command(args: argparse.Namespace) -> int:
    from spotinfer.simulator import bench_calibration, calibration

    kwargs = {} if args.boot_seconds is None else {"boot_seconds": args.boot_seconds}
    try:
        cal = bench_calibration.from_bench(args.from_bench, **kwargs)
    except FileNotFoundError as exc:
        raise UserError(str(exc)) from exc
    calibration.save(cal, args.out)
    print(json.dumps(cal.to_json(), indent=2))
    return 0


def validate_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from spotinfer.simulator.drill_replay import load_runs, replay

    cal = _calibration(args.calibration)
    grid = Table(title=f"{args.scenario} drill replayed with {cal.name}")
    for column in (
        "policy",
        "P50 measured",
        "P50 predicted",
        "residual",
        "P99 measured",
        "P99 predicted",
        "residual",
        "recomputed",
        "migrations",
        "restarts",
        "meas./pred. while a node boots",
        "meas./pred. otherwise",
    ):
        grid.add_column(column, justify="right")
    rows = []
    for run in load_runs(args.drill, args.scenario):
        prediction, _ = replay(run, cal)
        rows.append(
            {
                "policy": run.policy,
                "p50_measured_seconds": run.measured_p50_seconds,
                "p50_predicted_seconds": prediction.p50_seconds,
                "p50_residual": prediction.p50_residual,
                "p99_measured_seconds": run.measured_p99_seconds,
                "p99_predicted_seconds": prediction.p99_seconds,
                "p99_residual": prediction.p99_residual,
                "recomputed_tokens": prediction.recomputed_tokens,
                "migrations": prediction.migrations,
                "restarts": prediction.restarts,
                "measured_over_predicted_while_a_node_boots": prediction.ratio_during_boots,
                "measured_over_predicted_otherwise": prediction.ratio_otherwise,
            }
        )
        grid.add_row(
            run.policy,
            f"{run.measured_p50_seconds:.2f} s",
            f"{prediction.p50_seconds:.2f} s",
            f"{100 * prediction.p50_residual:+.1f}%",
            f"{run.measured_p99_seconds:.2f} s",
            f"{prediction.p99_seconds:.2f} s",
            f"{100 * prediction.p99_residual:+.1f}%",
            f"{prediction.recomputed_tokens:,}",
            str(prediction.migrations),
            str(prediction.restarts),
            f"{prediction.ratio_during_boots:.2f}",
            f"{prediction.ratio_otherwise:.2f}",
        )
    Console().print(grid)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "drill": str(args.drill),
                    "scenario": args.scenario,
                    "calibration": cal.to_json(),
                    "runs": rows,
                },
                indent=2,
            )
            + "\n"
        )
    return 0
