"""Bad operator input to `spotinfer worker` is one readable line and a non-zero exit."""

from __future__ import annotations

import subprocess
import sys

from spotinfer.local.worker_process import REPO_ROOT


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spotinfer", "worker", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_missing_model_folder() -> None:
    result = _run("--model", "/no/such/model", "--port", "0")
    assert result.returncode != 0
    assert "does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_value() -> None:
    result = _run("--model", "/tmp", "--max-num-seqs", "0")
    assert result.returncode != 0
    assert "max_num_seqs must be at least 1" in result.stderr
    assert "Traceback" not in result.stderr


def test_model_is_required() -> None:
    result = _run()
    assert result.returncode != 0
    assert "--model" in result.stderr
