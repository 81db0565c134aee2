"""One real worker process on the tiny model, shared by the worker tests of a module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from spotinfer.local.worker_process import WorkerProcess

# float32: on CPU, bf16 kernels depend on the batch size (see DESIGN.md), and these tests
# compare outputs token for token.
WORKER_FLAGS = ("--dtype", "float32", "--max-model-len", "1024", "--memory-gib", "0.25")


@pytest.fixture(scope="package")
def worker(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    with WorkerProcess(
        tiny_model, *WORKER_FLAGS, log_dir=tmp_path_factory.mktemp("worker-logs")
    ) as process:
        yield process
