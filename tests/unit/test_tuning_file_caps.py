"""The coordinator's per-class caps follow a tuning file; explicit flags win."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig, apply_tuning_file


def _file(tmp_path: Path, classes: dict[str, dict[str, int]]) -> str:
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"version": 1, "model": "m", "worker": {}, "classes": classes}))
    return str(path)


def test_caps_come_from_the_tuning_file(tmp_path: Path) -> None:
    tuning = _file(tmp_path, {"interactive": {"max_num_seqs": 16}, "batch": {"max_num_seqs": 64}})
    config = apply_tuning_file(CoordinatorConfig(tuning_file=tuning))
    assert (config.interactive_max_per_worker, config.batch_max_per_worker) == (16, 64)


def test_explicit_flags_win(tmp_path: Path) -> None:
    tuning = _file(tmp_path, {"interactive": {"max_num_seqs": 16}, "batch": {"max_num_seqs": 64}})
    config = apply_tuning_file(CoordinatorConfig(tuning_file=tuning, interactive_max_per_worker=4))
    assert (config.interactive_max_per_worker, config.batch_max_per_worker) == (4, 64)


def test_no_file_changes_nothing() -> None:
    config = CoordinatorConfig()
    assert apply_tuning_file(config) is config


def test_a_bad_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="positive max_num_seqs"):
        apply_tuning_file(
            CoordinatorConfig(tuning_file=_file(tmp_path, {"batch": {"max_num_seqs": 0}}))
        )
