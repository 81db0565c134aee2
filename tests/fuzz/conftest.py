"""The fuzz suite's own cluster: one coordinator in front of one real worker on the tiny model,
shared by the package and by no one else, so the Control calls the fuzzer makes (Drain,
InjectNotice, RegisterWorker) cannot disturb other tests.

The worker's limits are small on purpose: every request the fuzzer gets accepted asks at most
`MAX_TOKENS_LIMIT` tokens of a 128-token context, so a valid case costs milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from protos.spotinfer.v1 import control_pb2
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.worker_process import WorkerProcess
from tests.coordinator.conftest import greedy, health_of, start_coordinator
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until

WORKER_ID = "fuzz-w0"
MAX_MODEL_LEN = 128
MAX_TOKENS_LIMIT = 8
WORKER_FLAGS = (
    *("--dtype", "float32", "--memory-gib", "0.25", "--worker-id", WORKER_ID),
    *("--max-model-len", str(MAX_MODEL_LEN), "--max-tokens-limit", str(MAX_TOKENS_LIMIT)),
)
# Requests that finished before fuzzing starts: Attach and Cancel also meet ids that exist.
FINISHED_REQUEST_IDS = ("fuzz-finished-0", "fuzz-finished-1")
# Nothing listens on these (discard port, a reserved port): the fuzzer's Control calls name
# them, registered before it starts, so Drain and InjectNotice reach a worker that is
# registered but does not answer.
DEAD_ADDRESSES = ("127.0.0.1:9", "localhost:1", "[::1]:9")
SETTLE_TIMEOUT_SECONDS = 60.0


@dataclass
class FuzzCluster:
    coordinator: CoordinatorProcess
    worker: WorkerProcess
    cases: dict[str, int] = field(default_factory=dict)
    """Inputs sent, by the name of the test that sent them (what the counts assert)."""

    @property
    def channel(self) -> grpc.Channel:
        assert self.coordinator.channel is not None
        return self.coordinator.channel

    @property
    def protected(self) -> tuple[str, ...]:
        """The real worker's names: fuzzed Control calls never name it (see test_grpc_fuzz)."""
        return (WORKER_ID, self.worker.address)

    def count(self, name: str, cases: int = 1) -> None:
        self.cases[name] = self.cases.get(name, 0) + cases

    def in_flight(self) -> int:
        status = self.coordinator.control.ClusterStatus(
            control_pb2.ClusterStatusRequest(), timeout=5
        )
        return int(status.in_flight)

    def assert_settled(self) -> None:
        """Health SERVING and nothing in flight (requests the fuzzer left finish or end)."""
        wait_until(
            lambda: health_of(self.coordinator) == 1 and self.in_flight() == 0,
            lambda: (
                f"health {health_of(self.coordinator)}, in flight {self.in_flight()}; "
                f"coordinator output:\n{self.coordinator.output[-3000:]}"
            ),
            SETTLE_TIMEOUT_SECONDS,
            0.1,
        )


@pytest.fixture(scope="package")
def fuzz_cluster(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[FuzzCluster]:
    log_dir = tmp_path_factory.mktemp("fuzz-logs")
    worker = WorkerProcess(tiny_model, *WORKER_FLAGS, log_dir=log_dir)
    coordinator: CoordinatorProcess | None = None
    try:
        worker.start()
        # With a store: the Batch API's routes are fuzzed for real, not only refused.
        coordinator = start_coordinator(
            *("--worker", worker.address, "--model", str(tiny_model)),
            *("--redis-url", redis_server.url),
            log_dir=log_dir,
        )
        for request_id in FINISHED_REQUEST_IDS:
            list(coordinator.inference.Generate(greedy([1, 2, 3], 2, request_id), timeout=60))
        for address in DEAD_ADDRESSES:
            coordinator.control.RegisterWorker(
                control_pb2.RegisterWorkerRequest(address=address), timeout=10
            )
        yield FuzzCluster(coordinator, worker)
    finally:
        if coordinator is not None:
            coordinator.stop()
        worker.stop()
