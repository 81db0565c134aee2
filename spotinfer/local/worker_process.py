"""A real worker process (`python -m worker`) run by tests, benchmarks and the local cluster.

The process is started with the test environment (OMP_NUM_THREADS=1, no vLLM
multiprocessing of its own beyond the engine core), waited for until its health says
SERVING, and always stopped — SIGTERM first, SIGKILL if it does not go.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from common.channels import PLAINTEXT, TransportConfig
from protos.spotinfer.v1 import worker_pb2_grpc
from spotinfer.local.managed_process import (
    REPO_ROOT,
    ServiceProcess,
    free_port,
    process_environment,
)

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["REPO_ROOT", "WorkerProcess", "free_port", "process_environment"]

READY_TIMEOUT_SECONDS = 180.0
DRAIN_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 30.0


class WorkerProcess(ServiceProcess):
    """`with WorkerProcess(model, "--dtype", "float32") as worker: worker.stub.Generate(...)`."""

    def __init__(
        self,
        model: Path | str,
        *flags: str,
        log_dir: Path | None = None,
        metrics: bool = False,
        transport: TransportConfig = PLAINTEXT,
    ) -> None:
        super().__init__("worker", log_dir, metrics, transport=transport)
        self._cmd = [
            *(sys.executable, "-m", "worker"),
            *("--model", str(model)),
            *("--port", str(self.port)),
            *self.metrics_flags,
            *flags,
        ]

    def start(self, wait_ready: bool = True) -> Self:
        self.spawn(self._cmd)
        if wait_ready:
            self.wait_serving()
        return self

    def wait_serving(
        self, timeout: float = READY_TIMEOUT_SECONDS, poll_seconds: float = 0.2
    ) -> None:
        super().wait_serving(timeout, poll_seconds)

    @property
    def stub(self) -> worker_pb2_grpc.WorkerStub:
        assert self.channel is not None
        return worker_pb2_grpc.WorkerStub(self.channel)

    def terminate(self, timeout: float = DRAIN_TIMEOUT_SECONDS) -> int:
        """SIGTERM (a drain), then the exit code; SIGKILL if it does not stop in time."""
        assert self.process is not None
        code = super().terminate(timeout)
        assert code is not None
        return code

    def stop(self) -> None:
        self.close_channel()
        if self.running:
            self.terminate(timeout=STOP_TIMEOUT_SECONDS)
