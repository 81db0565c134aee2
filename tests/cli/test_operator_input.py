"""Bad operator input to the cluster commands: one clear line, a non-zero exit, no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from spotinfer.local.worker_process import REPO_ROOT


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spotinfer", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _one_clear_line(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_unknown_scenario(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _one_clear_line(_run("drill", "earthquake", "--model", str(tmp_path)), "unknown scenario")


def test_model_path_that_does_not_exist() -> None:
    _one_clear_line(_run("drill", "notice", "--model", "/no/such/model"), "no such model folder")
    _one_clear_line(_run("up", "--model", "/no/such/model", "--port", "0"), "no such model folder")


def test_port_in_use(busy_port: int, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _one_clear_line(_run("up", "--model", str(tmp_path), "--port", str(busy_port)), "in use")


def test_unreachable_target() -> None:
    _one_clear_line(_run("status", "--target", "127.0.0.1:9"), "cannot reach a coordinator")
    _one_clear_line(_run("generate", "--target", "127.0.0.1:9", "hi"), "cannot reach a coordinator")


def test_trace_without_a_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _one_clear_line(_run("drill", "trace", "--model", str(tmp_path)), "needs --trace FILE")


def test_batch_without_its_file_or_its_front(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _one_clear_line(_run("batch", "submit", str(tmp_path / "none.jsonl")), "none.jsonl")
    jobs = tmp_path / "in.jsonl"
    jobs.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n')
    _one_clear_line(
        _run("batch", "submit", str(jobs), "--url", "http://127.0.0.1:9"),
        "cannot reach the coordinator's HTTP front",
    )


def test_a_redis_cluster_too_small_to_start(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text("{}")
    model = ("--model", str(tmp_path))
    _one_clear_line(_run("drill", "notice", *model, "--redis-cluster-masters", "2"), "at least 3")
    up = ("up", *model, "--port", "0", "--http-port", "0")
    _one_clear_line(_run(*up, "--redis-cluster-masters", "1"), "at least 3")
