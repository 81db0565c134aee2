"""Reference outputs from vLLM's offline `LLM.generate` on the tiny model, run by
tests/support/offline_reference.py in a process of its own (the test process never imports
vLLM; see that script for the request and answer shapes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from spotinfer.local.worker_process import REPO_ROOT, process_environment

REFERENCE_SCRIPT = "tests/support/offline_reference.py"


def run_offline_reference(
    model: Path,
    requests: list[dict[str, Any]],
    folder: Path,
    max_model_len: int = 1024,
    timeout_seconds: float = 300.0,
) -> Any:
    """The offline engine's answer to ``requests`` (float32, greedy), files kept in
    ``folder``."""
    requests_path, out = folder / "requests.json", folder / "reference.json"
    requests_path.write_text(json.dumps(requests))
    engine = {"dtype": "float32", "max_model_len": max_model_len, "kv_cache_memory_bytes": 64 << 20}
    subprocess.run(
        [sys.executable, REFERENCE_SCRIPT, str(model), str(requests_path), str(out)]
        + [json.dumps(engine)],
        cwd=REPO_ROOT,
        env=process_environment(),
        check=True,
        capture_output=True,
        timeout=timeout_seconds,
    )
    return json.loads(out.read_text())
