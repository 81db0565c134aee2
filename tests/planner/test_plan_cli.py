"""`spotinfer plan` as a user runs it: a real subprocess, JSON or a table, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from known_model_configs import LLAMA_3_8B, LLAMA_3_70B

REPO_ROOT = Path(__file__).resolve().parents[2]


def _spotinfer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spotinfer", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def llama_8b_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_3_8B))
    return path


def test_json_output_carries_the_plan(llama_8b_config: Path) -> None:
    result = _spotinfer(
        "plan",
        "--config",
        str(llama_8b_config),
        "--memory-gib",
        "80",
        "--context",
        "8192",
        "--dtype",
        "bf16",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["kv_bytes_per_token"] == 131072
    assert plan["weight_bytes"] == 2 * 8_030_261_248
    assert plan["kv_budget_bytes"] == 80 * 2**30 * 10 // 11 - plan["weight_bytes"]
    assert plan["max_concurrent_seqs"] == 57
    assert plan["max_concurrent_seqs_by_context"]["8192"] == 57
    assert "32768" not in plan["max_concurrent_seqs_by_context"]  # beyond 8192 positions


def test_a_model_folder_and_tensor_parallelism(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_70B))
    result = _spotinfer(
        "plan",
        "--config",
        str(tmp_path),
        "--memory-gib",
        "80",
        "--context",
        "4096",
        "--tp",
        "4",
        "--block-tokens",
        "16",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["kv_bytes_per_token"] == 327680 // 4
    assert plan["tensor_parallel_size"] == 4


def test_the_table_shows_the_numbers(llama_8b_config: Path) -> None:
    result = _spotinfer(
        "plan", "--config", str(llama_8b_config), "--memory-gib", "80", "--context", "8192"
    )
    assert result.returncode == 0, result.stderr
    assert "131,072 B" in result.stdout
    assert "8,030,261,248" in result.stdout
    rows = [line for line in result.stdout.splitlines() if "8,192" in line and "57" in line]
    assert rows, result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--config", "/nonexistent/config.json", "--memory-gib", "80", "--context", "8192"],
            "no model config",
        ),
        (["--memory-gib", "eighty", "--context", "8192"], "--memory-gib must be a number"),
        (["--memory-gib", "80", "--context", "-5"], "--context must be positive"),
        (["--memory-gib", "80", "--context", "8192", "--tp", "1.5"], "--tp must be a whole number"),
        (["--memory-gib", "16", "--context", "8192"], "weights alone"),
        (["--memory-gib", "80", "--context", "8192", "--dtype", "int2"], "unknown dtype"),
    ],
)
def test_bad_input_is_one_error_line(llama_8b_config: Path, args: list[str], message: str) -> None:
    if "--config" not in args:
        args = ["--config", str(llama_8b_config), *args]
    result = _spotinfer("plan", *args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
