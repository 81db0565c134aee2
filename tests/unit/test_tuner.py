"""The tuner's choice respects each class's targets and prefers throughput."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from common.tuning_file import load_tuning_file
from spotinfer.loadgen import LoadSummary
from spotinfer.tuner import (
    SlaTargets,
    SweepPoint,
    TuneConfig,
    plot,
    recommend,
    tuning_file,
)


def _point(batch: int, tps: float, ttft_p99: float, tpot_p99: float) -> SweepPoint:
    summary = LoadSummary(
        requests=8,
        completed=8,
        errors={},
        wall_seconds=1.0,
        output_tokens=int(tps),
        tokens_per_second=tps,
        ttft_ms_p50=ttft_p99 / 2,
        ttft_ms_p99=ttft_p99,
        tpot_ms_p50=tpot_p99 / 2,
        tpot_ms_p99=tpot_p99,
        e2e_ms_p50=0,
        e2e_ms_p99=0,
        duplicates=0,
        gaps=0,
    )
    return SweepPoint(batch, 0.0, summary, 0.5, batch, 0.1, "cpu-time-estimate", True)


POINTS = [
    _point(1, 20, 100, 30),
    _point(4, 70, 300, 45),
    _point(16, 120, 900, 90),
    _point(64, 125, 4000, 300),
]


def test_each_class_gets_the_fastest_setting_within_its_targets() -> None:
    config = TuneConfig(interactive=SlaTargets(1000, 100), batch=SlaTargets())
    choices = {c.sla_class: c for c in recommend(POINTS, config)}
    assert choices["interactive"].point is not None
    assert choices["interactive"].point.max_num_seqs == 16
    assert choices["batch"].point is not None
    assert choices["batch"].point.max_num_seqs == 64


def test_no_setting_meets_impossible_targets() -> None:
    config = TuneConfig(interactive=SlaTargets(10, 1))
    interactive = recommend(POINTS, config)[0]
    assert interactive.point is None
    assert "no swept setting" in interactive.reason


def test_a_point_with_failed_requests_meets_no_target() -> None:
    broken = _point(8, 1000, 10, 10)
    broken = SweepPoint(
        8, 0.0, LoadSummary(**{**broken.summary.__dict__, "completed": 7}), 0.5, 8, 0.1, "x", True
    )
    choice = recommend([*POINTS, broken], TuneConfig(interactive=SlaTargets(1000, 100)))[0]
    assert choice.point is not None and choice.point.max_num_seqs == 16


def test_tuning_file_round_trip(tmp_path: Path) -> None:
    choices = recommend(POINTS, TuneConfig(interactive=SlaTargets(1000, 100)))
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(tuning_file(choices, "m")))
    data = load_tuning_file(path)
    assert data["classes"] == {"interactive": {"max_num_seqs": 16}, "batch": {"max_num_seqs": 64}}
    assert data["worker"] == {"max_num_seqs": 64}
    path.write_text(json.dumps({"version": 1, "classes": {"batch": {"max_num_seqs": 0}}}))
    with pytest.raises(ValueError, match="positive max_num_seqs"):
        load_tuning_file(path)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    choices = recommend(POINTS, TuneConfig(interactive=SlaTargets(1000, 100)))
    out = plot(POINTS, choices, tmp_path / "tune.png", "model")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_targets_must_be_positive() -> None:
    with pytest.raises(ValueError):
        SlaTargets(0, 10)
    assert math.isinf(SlaTargets().ttft_p99_ms)
