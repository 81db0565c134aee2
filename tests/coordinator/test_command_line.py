"""Bad operator input stops `python -m coordinator` with one readable line, not a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spotinfer.local.worker_process import REPO_ROOT, process_environment


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--worker", "no-port-here"], "host:port"),
        (["--routing-policy", "random-ish"], "least-loaded"),
        (["--failover-policy", "hope"], "resume"),
        (["--heartbeat-interval-seconds", "2", "--lost-after-seconds", "1"], "lost_after_seconds"),
        (["--model", "/nonexistent/model"], "not a model folder"),
    ],
)
def test_bad_flags_are_one_line_errors(flags: list[str], words: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "--port", "0", "--http-port", "0", *flags],
        cwd=REPO_ROOT,
        env=process_environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert words in done.stderr
    assert "Traceback" not in done.stderr
