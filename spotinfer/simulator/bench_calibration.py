"""A CPU calibration from this project's own benchmark results (``docs/bench/*.json``).

    tune.json (burst points)      ─ least squares ─▶ step base, per sequence, per prompt token
    tuning.json                   ─────────────────▶ max_num_seqs
    grace_capacity.json           ─────────────────▶ KV bytes per token, store write MB/s
    resume_latency_noticed.json   ─────────────────▶ store read MB/s (the resume's KV load)
    migration_downtime.json       ─────────────────▶ switch downtime, staging cost per MB
    relay_overhead.json           ─────────────────▶ the coordinator's added TTFT

The step model is fitted on the burst points of the batch-size sweep: a point with
max_num_seqs b, N requests, D output and P prompt tokens takes about
``base × D / b + per_seq × D + per_prompt_token × P`` seconds (D / b steps, each with b
sequences, plus the prefills). Boot time is not in any JSON; it is a parameter, with the
figure the drills saw as default.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from spotinfer.simulator.calibration import Calibration

BLOCK_TOKENS_CPU = 128  # vLLM's KV block on CPU
# `spotinfer tune`'s default --prompt-tokens (64,128): tune.json does not record the range.
TUNE_PROMPT_TOKENS_MEAN = 96.0
# The drills' replacements booted in 30-55 s on this box (docs/benchmarks.md, rolling drill);
# no JSON records it.
DEFAULT_BOOT_SECONDS = 45.0


def _read(bench_dir: Path, name: str) -> Any:
    path = bench_dir / name
    if not path.exists():
        raise FileNotFoundError(f"{path}: the calibration needs this benchmark's JSON")
    return json.loads(path.read_text())


def fit_step_model(tune: dict[str, Any], prompt_tokens_mean: float) -> tuple[float, float, float]:
    """(base, per sequence, per prompt token) seconds, least squares over the burst points."""
    rows, walls = [], []
    for point in tune["points"]:
        if point["rate_per_second"] != 0:
            continue  # only a burst keeps the batch at max_num_seqs
        summary = point["summary"]
        batch = point["max_num_seqs"]
        decoded = summary["output_tokens"]
        rows.append([decoded / batch, decoded, prompt_tokens_mean * summary["requests"]])
        walls.append(summary["wall_seconds"])
    if len(rows) < 3:
        raise ValueError("tune.json needs at least 3 burst points (rate 0) to fit the step")
    coefficients, *_ = np.linalg.lstsq(np.array(rows), np.array(walls), rcond=None)
    base, per_seq, per_prompt = (max(0.0, float(c)) for c in coefficients)
    return base, per_seq, per_prompt


def _store_read_mb_per_second(noticed: dict[str, Any]) -> float:
    rates = [
        statistics.median(row["load_mb"]) / (row["load_ms_median"] / 1000)
        for row in noticed["summary"]
        if row.get("load_ms_median")
    ]
    return statistics.median(rates)


def _staging(downtime: dict[str, Any], kv_bytes_per_block: float) -> tuple[float, float]:
    """(fixed seconds, MB/s) of staging, a line through the measured stage times."""
    blocks = [row["staged_blocks_median"] for row in downtime["summary"]]
    seconds = [row["staging_ms_median"] / 1000 for row in downtime["summary"]]
    slope, intercept = np.polyfit(np.array(blocks, dtype=float), np.array(seconds), 1)
    mb_per_block = kv_bytes_per_block / 1e6
    return max(0.0, float(intercept)), mb_per_block / max(float(slope), 1e-9)


def from_bench(bench_dir: Path, boot_seconds: float = DEFAULT_BOOT_SECONDS) -> Calibration:
    tune = _read(bench_dir, "tune.json")
    tuning = _read(bench_dir, "tuning.json")
    grace = _read(bench_dir, "grace_capacity.json")
    noticed = _read(bench_dir, "resume_latency_noticed.json")
    downtime = _read(bench_dir, "migration_downtime.json")
    relay = _read(bench_dir, "relay_overhead.json")

    base, per_seq, per_prompt = fit_step_model(tune, TUNE_PROMPT_TOKENS_MEAN)
    kv_bytes = int(grace["kv_bytes_per_token"])
    staging_fixed, peer_mb_s = _staging(downtime, kv_bytes * BLOCK_TOKENS_CPU)
    switch = statistics.median(row["gap_ms_median"] for row in downtime["summary"]) / 1000
    sources = {
        "step_base_seconds": "fit on tune.json burst points (wall ≈ base·D/b + per_seq·D + "
        "per_prompt·P)",
        "step_per_seq_seconds": "same fit",
        "step_per_context_token_seconds": "0: not separable from the per-sequence cost at the "
        "contexts tune.json ran (≤ 176 tokens)",
        "prefill_per_token_seconds": "same fit (the prompt term), prompts 64-128 tokens "
        "(tune's default; resume_latency.json's lone re-prefills give ~2 ms/token)",
        "max_num_seqs": "tuning.json worker.max_num_seqs",
        "kv_bytes_per_token": "grace_capacity.json kv_bytes_per_token (bfloat16)",
        "block_tokens": "vLLM's KV block on CPU",
        "store_write_mb_per_second": "grace_capacity.json flush_mb_per_second",
        "store_read_mb_per_second": "resume_latency_noticed.json: median load_mb / load_ms",
        "peer_mb_per_second": "migration_downtime.json: staged blocks vs staging_ms, slope "
        "(here the standby stages from the store)",
        "staging_overhead_seconds": "migration_downtime.json: the same line's intercept",
        "switch_downtime_seconds": "migration_downtime.json: median of gap_ms_median",
        "boot_seconds": "docs/benchmarks.md rolling drill: replacements booted in 30-55 s "
        "(no JSON records it); --boot-seconds",
        "request_overhead_seconds": "relay_overhead.json added_ttft_ms_p50",
    }
    return Calibration(
        name="smollm2-135m-cpu",
        step_base_seconds=base,
        step_per_seq_seconds=per_seq,
        step_per_context_token_seconds=0.0,
        prefill_per_token_seconds=per_prompt,
        max_num_seqs=int(tuning["worker"]["max_num_seqs"]),
        kv_bytes_per_token=kv_bytes,
        block_tokens=BLOCK_TOKENS_CPU,
        store_write_mb_per_second=float(grace["flush_mb_per_second"]),
        store_read_mb_per_second=_store_read_mb_per_second(noticed),
        peer_mb_per_second=peer_mb_s,
        staging_overhead_seconds=staging_fixed,
        switch_downtime_seconds=switch,
        boot_seconds=boot_seconds,
        request_overhead_seconds=float(relay["added_ttft_ms_p50"]) / 1000,
        sources=sources,
    )
