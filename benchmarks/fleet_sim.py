"""Fleet simulator benchmarks for docs/benchmarks.md: every policy on a 100-node fleet over
SpotServe's A_S trace (scaled to the fleet, tiled) and over generated correlated waves, with
the GPU calibrations (Llama-3-8B on one H100, Llama-3-70B on 8× H100); one JSON and one PNG.

    python -m benchmarks.fleet_sim [--hours 6] [--json docs/bench/fleet_sim.json]
        [--png docs/bench/fleet_sim.png]

Each case is one `spotinfer simulate run` (its command is in the JSON).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from spotinfer.cli import main as spotinfer_main
from spotinfer.commands.simulate import default_trace
from spotinfer.simulator import report

# A chat service's targets on a GPU (an assumption; the CLI's default is the tuner's CPU one).
INTERACTIVE_SLO = "1,0.05"
# (label, calibration, instance type, cohort): cohorts keep ≥ 8 per node's batch.
MODELS = (
    ("8B/H100", "llama3-8b-h100", "h100x1", 16),
    ("70B/8×H100", "llama3-70b-8xh100", "h100x8", 32),
)


def cases(hours: float, trace: Path, waves_per_day: float) -> list[tuple[str, list[str]]]:
    out = []
    for label, calibration, instance, cohort in MODELS:
        common = [
            "--calibration",
            calibration,
            "--instance-type",
            instance,
            "--nodes",
            "100",
            "--standbys",
            "5",
            "--hours",
            str(hours),
            "--cohort",
            str(cohort),
            "--slo-interactive",
            INTERACTIVE_SLO,
        ]
        out.append((f"A_S · {label}", [*common, "--trace", str(trace)]))
        out.append(
            (
                f"waves · {label}",
                [
                    *common,
                    "--trace",
                    "waves",
                    "--zones",
                    "3",
                    "--waves-per-zone-per-day",
                    str(waves_per_day),
                ],
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=6.0)
    parser.add_argument("--trace", type=Path, default=default_trace())
    parser.add_argument("--waves-per-zone-per-day", type=float, default=8.0)
    parser.add_argument("--json", type=Path, default=Path("docs/bench/fleet_sim.json"))
    parser.add_argument("--png", type=Path, default=Path("docs/bench/fleet_sim.png"))
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    meta: dict[str, Any] = {"cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        for scenario, argv in cases(args.hours, args.trace, args.waves_per_zone_per_day):
            out = Path(tmp) / "case.json"
            command = ["simulate", "run", *argv, "--scenario", scenario, "--json", str(out)]
            if spotinfer_main(command) != 0:
                raise SystemExit(f"{scenario} failed")
            body = json.loads(out.read_text())
            runs.extend(body.pop("runs"))
            meta["cases"].append(
                {
                    "scenario": scenario,
                    "command": "spotinfer " + " ".join(command[:-2]),
                    **{
                        k: body[k]
                        for k in ("rate_per_second", "cohort", "grace_seconds", "trace", "price")
                    },
                    "calibration": body["calibration"]["name"],
                }
            )
    summaries = [report.RunSummary(**r) for r in runs]
    report.write_json(summaries, args.json, meta)
    report.plot(summaries, args.png, title=f"100 nodes, {args.hours:g} h, cost and SLA per policy")
    print(f"wrote {args.json} and {args.png}")


if __name__ == "__main__":
    main()
