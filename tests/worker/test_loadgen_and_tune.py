"""The load generator and the tuner against real worker processes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from common.tuning_file import load_tuning_file
from spotinfer.loadgen import Arrival, LoadSpec, plan_requests, run_load, summarize
from spotinfer.local.worker_process import REPO_ROOT, WorkerProcess, process_environment


def test_poisson_load_completes_exactly_once(worker: WorkerProcess) -> None:
    spec = LoadSpec(
        num_requests=12,
        rate_per_second=20,
        arrival=Arrival.POISSON,
        prompt_tokens=(8, 40),
        output_tokens=(4, 16),
        batch_fraction=0.5,
        vocab_high=500,
    )
    planned = plan_requests(spec, prefix="loadgen-test")
    traces = asyncio.run(run_load(worker.address, planned, service="worker"))
    summary = summarize(traces)
    assert summary.completed == 12, summary.errors
    assert summary.duplicates == 0 and summary.gaps == 0
    for plan, trace in zip(planned, traces, strict=True):
        assert len(trace.token_ids) == plan.max_tokens
        assert len(trace.token_times) == plan.max_tokens
        assert trace.ttft_seconds is not None and trace.ttft_seconds > 0


def test_tune_produces_table_json_png_and_a_tuning_file(tiny_model: Path, tmp_path: Path) -> None:
    out_json, out_png, apply = tmp_path / "t.json", tmp_path / "t.png", tmp_path / "apply.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "spotinfer",
            "tune",
            "--model",
            str(tiny_model),
            "--batch-sizes",
            "1,4",
            "--rates",
            "0",
            "--requests",
            "4",
            "--prompt-tokens",
            "8,16",
            "--output-tokens",
            "6,6",
            "--dtype",
            "float32",
            "--kv-cache-gib",
            "0.05",
            "--max-model-len",
            "256",
            "--interactive-ttft-p99-ms",
            "60000",
            "--interactive-tpot-p99-ms",
            "60000",
            "--json",
            str(out_json),
            "--png",
            str(out_png),
            "--apply",
            str(apply),
        ],
        cwd=REPO_ROOT,
        env=process_environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "max_num_seqs" in result.stdout
    data = json.loads(out_json.read_text())
    assert sorted(p["max_num_seqs"] for p in data["points"]) == [1, 4]
    assert all(p["summary"]["completed"] == p["summary"]["requests"] for p in data["points"])
    assert all(p["energy_is_estimate"] for p in data["points"]), "no GPU here: an estimate"
    interactive = next(c for c in data["choices"] if c["sla_class"] == "interactive")
    assert interactive["max_num_seqs"] in (1, 4)
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    assert load_tuning_file(apply)["classes"]["interactive"]["max_num_seqs"] in (1, 4)


def test_tune_refuses_bad_input(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "spotinfer", "tune", "--model", str(tmp_path), "--batch-sizes", "a"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "--batch-sizes must be comma-separated integers" in result.stderr
    assert "Traceback" not in result.stderr
