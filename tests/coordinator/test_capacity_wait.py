"""A capacity gap against real processes: a request sent to a coordinator that has no worker
yet waits in its queue and completes once a worker registers itself; with a short capacity
wait and still no worker, it is refused RESOURCE_EXHAUSTED with the retry hint."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from protos.spotinfer.v1 import common_pb2, control_pb2
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.worker_process import WorkerProcess
from tests.coordinator.conftest import WORKER_FLAGS, assemble, greedy, start_coordinator, status_of
from tests.support.wait import wait_until

PROMPT_IDS = [5, 17, 42, 99]
RETRY_AFTER_MS = 700
# Long enough for a worker to start on a loaded machine: the test asserts that it waited.
LONG_WAIT_SECONDS = 600


def _waiting(process: CoordinatorProcess) -> int:
    status = process.control.ClusterStatus(control_pb2.ClusterStatusRequest(), timeout=10)
    return next(q.depth for q in status.queues if q.sla_class == common_pb2.SLA_CLASS_INTERACTIVE)


def test_a_request_past_a_short_wait_is_refused_with_a_retry_hint(tmp_path: Path) -> None:
    coordinator = start_coordinator(
        *("--capacity-wait-seconds", "0.5", "--retry-after-ms", str(RETRY_AFTER_MS)),
        log_dir=tmp_path,
        wait_serving=False,
    )
    try:
        with pytest.raises(grpc.RpcError) as refused:
            list(coordinator.inference.Generate(greedy(PROMPT_IDS, 4, "too-late"), timeout=60))
        assert status_of(refused.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "no worker became available within 0.5 s" in refused.value.details()  # type: ignore[attr-defined]
        hints = dict(refused.value.trailing_metadata())  # type: ignore[attr-defined]
        assert hints["retry-after-ms"] == str(RETRY_AFTER_MS)
        assert _waiting(coordinator) == 0, "the refused request left its queue"
    finally:
        coordinator.stop()


def test_a_request_sent_before_any_worker_completes_once_one_joins(
    tiny_model: Path, tmp_path: Path
) -> None:
    coordinator = start_coordinator(
        *("--capacity-wait-seconds", str(LONG_WAIT_SECONDS)),
        log_dir=tmp_path / "coordinator",
        wait_serving=False,
    )
    worker = WorkerProcess(
        tiny_model,
        *WORKER_FLAGS,
        *("--worker-id", "late", "--coordinator", coordinator.address),
        log_dir=tmp_path,
    )
    try:
        responses = coordinator.inference.Generate(
            greedy(PROMPT_IDS, 6, "early"), timeout=LONG_WAIT_SECONDS
        )
        wait_until(lambda: _waiting(coordinator) == 1, "the request waits in its queue", 30, 0.1)
        worker.start()
        received = list(responses)
        assert len(assemble(received)) == 6
        assert received[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert {r.worker_id for r in received if r.token_ids} == {"late"}
    finally:
        worker.stop()
        coordinator.stop()
