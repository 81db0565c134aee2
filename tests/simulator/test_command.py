"""`spotinfer simulate` as a user runs it: a small fleet end to end, and the calibration
command reproducing the packaged CPU calibration from the benchmark JSONs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotinfer.cli import main
from spotinfer.simulator.calibration import DATA_DIR

BENCH = Path(__file__).resolve().parents[2] / "docs" / "bench"


def test_run_writes_every_policy_with_on_demand_dearest(tmp_path: Path) -> None:
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    code = main(
        [
            "simulate", "run", "--calibration", "llama3-8b-h100", "--instance-type", "h100x1",
            "--nodes", "6", "--standbys", "1", "--hours", "0.1", "--trace", "waves",
            "--waves-per-zone-per-day", "200", "--json", str(out), "--png", str(png),
        ]
    )  # fmt: skip
    assert code == 0
    runs = {r["policy"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"spotinfer", "reroute", "on-demand", "skyserve"}
    assert all(r["completed"] == r["requests"] for r in runs.values())
    assert (
        runs["on-demand"]["cost_per_million_tokens"] > runs["spotinfer"]["cost_per_million_tokens"]
    )
    assert runs["spotinfer"]["recomputed_tokens"] == 0
    assert runs["spotinfer"]["notices"] > 0
    assert png.stat().st_size > 0


def test_calibrate_reproduces_the_packaged_cpu_calibration(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    assert main(["simulate", "calibrate", "--from-bench", str(BENCH), "--out", str(out)]) == 0
    made = json.loads(out.read_text())
    packaged = json.loads((DATA_DIR / "calibration_cpu.json").read_text())
    # The same fit, up to the last bits of a float (least squares sums in the order of the
    # installed numerics library).
    assert {k: v for k, v in made.items() if k != "values"} == {
        k: v for k, v in packaged.items() if k != "values"
    }
    assert made["values"].keys() == packaged["values"].keys()
    for name, value in made["values"].items():
        expected = packaged["values"][name]
        assert value["source"] == expected["source"], name
        assert value["value"] == pytest.approx(expected["value"], rel=1e-9), name
