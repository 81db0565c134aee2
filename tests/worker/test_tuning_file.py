"""A worker started with a tuning file runs the tuned workload batch size."""

from __future__ import annotations

import json
from pathlib import Path

from protos.spotinfer.v1 import worker_pb2
from spotinfer.local.worker_process import WorkerProcess


def test_worker_takes_max_num_seqs_from_the_tuning_file(tiny_model: Path, tmp_path: Path) -> None:
    tuning = tmp_path / "tuning.json"
    tuning.write_text(
        json.dumps(
            {
                "version": 1,
                "model": str(tiny_model),
                "worker": {"max_num_seqs": 3},
                "classes": {"interactive": {"max_num_seqs": 3}},
            }
        )
    )
    flags = ("--dtype", "float32", "--max-model-len", "512", "--kv-cache-bytes", str(16 << 20))
    with WorkerProcess(tiny_model, *flags, "--tuning-file", str(tuning), log_dir=tmp_path) as w:
        assert w.stub.Stats(worker_pb2.StatsRequest(), timeout=10).max_num_seqs == 3
