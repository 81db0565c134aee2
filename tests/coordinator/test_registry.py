"""Workers join by RegisterWorker; health follows worker readiness; standbys take no new
request until promoted; a worker that stops answering is LOST."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from protos.spotinfer.v1 import control_pb2
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.worker_process import WorkerProcess, free_port
from tests.coordinator.conftest import (
    TIMEOUT_SECONDS,
    assemble,
    greedy,
    health_of,
    start_coordinator,
    wait_for_health,
)
from tests.support.wait import wait_until

PROMPT_IDS = [5, 17, 42, 99]


@pytest.fixture
def empty(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    """A coordinator that starts with no worker at all, and refuses a request at once while
    it has none (no capacity wait: test_capacity_wait.py has the waiting one)."""
    process = start_coordinator(
        *("--lost-after-seconds", "2", "--capacity-wait-seconds", "0"),
        log_dir=tmp_path,
        wait_serving=False,
    )
    yield process
    process.stop()


def _workers(process: CoordinatorProcess) -> list[control_pb2.WorkerInfo]:
    return list(process.control.ListWorkers(control_pb2.ListWorkersRequest(), timeout=10).workers)


def _wait_state(process: CoordinatorProcess, address: str, state: int) -> control_pb2.WorkerInfo:
    def reached() -> control_pb2.WorkerInfo | None:
        return next(
            (i for i in _workers(process) if i.address == address and i.state == state), None
        )

    wait_until(reached, lambda: f"{address} in state {state}: {_workers(process)}", 30, 0.1)
    info = reached()
    assert info is not None
    return info


def test_health_follows_registration(
    empty: CoordinatorProcess, workers: list[WorkerProcess]
) -> None:
    assert health_of(empty) == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as refused:
        list(empty.inference.Generate(greedy(PROMPT_IDS, 4), timeout=TIMEOUT_SECONDS))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    answer = empty.control.RegisterWorker(
        control_pb2.RegisterWorkerRequest(address=workers[0].address), timeout=10
    )
    assert not answer.already_registered
    wait_for_health(empty, health_pb2.HealthCheckResponse.SERVING)
    info = _wait_state(empty, workers[0].address, control_pb2.WORKER_STATE_READY)
    assert info.worker_id == "w0"  # learnt from the worker's Stats
    assert info.role == control_pb2.WORKER_ROLE_ACTIVE
    assert info.stats.max_num_seqs > 0 and info.stats.kv_blocks_total > 0
    assert len(assemble(list(empty.inference.Generate(greedy(PROMPT_IDS, 6), timeout=60)))) == 6


def test_a_silent_worker_is_lost_and_health_drops(empty: CoordinatorProcess) -> None:
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there
    empty.control.RegisterWorker(control_pb2.RegisterWorkerRequest(address=nowhere), timeout=10)
    _wait_state(empty, nowhere, control_pb2.WORKER_STATE_LOST)
    assert health_of(empty) == health_pb2.HealthCheckResponse.NOT_SERVING


def test_standby_is_promoted_only_when_no_active_worker_is_left(
    empty: CoordinatorProcess, workers: list[WorkerProcess]
) -> None:
    for worker, role in zip(
        workers, (control_pb2.WORKER_ROLE_ACTIVE, control_pb2.WORKER_ROLE_STANDBY), strict=True
    ):
        empty.control.RegisterWorker(
            control_pb2.RegisterWorkerRequest(address=worker.address, role=role), timeout=10
        )
    _wait_state(empty, workers[1].address, control_pb2.WORKER_STATE_READY)
    _wait_state(empty, workers[0].address, control_pb2.WORKER_STATE_READY)
    status = empty.control.ClusterStatus(control_pb2.ClusterStatusRequest(), timeout=10)
    assert status.standbys_ready == 1
    responses = [
        list(empty.inference.Generate(greedy(PROMPT_IDS, 4), timeout=60)) for _ in range(4)
    ]
    assert {r.worker_id for rs in responses for r in rs} == {"w0"}, "the standby stays idle"

    # A notice takes the active one out of routing; the next request promotes the standby.
    empty.control.InjectNotice(
        control_pb2.InjectNoticeRequest(worker_id="w0", kind=control_pb2.NOTICE_KIND_TERMINATE),
        timeout=10,
    )
    served = list(empty.inference.Generate(greedy(PROMPT_IDS, 4), timeout=60))
    assert {r.worker_id for r in served} == {"w1"}
    roles = {info.worker_id: info.role for info in _workers(empty)}
    assert roles["w1"] == control_pb2.WORKER_ROLE_ACTIVE
    states = {info.worker_id: info.state for info in _workers(empty)}
    assert states["w0"] == control_pb2.WORKER_STATE_PREEMPTED
    status = empty.control.ClusterStatus(control_pb2.ClusterStatusRequest(), timeout=10)
    assert status.standbys_ready == 0
