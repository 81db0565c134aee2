"""A worker joins by itself: the coordinator is started with no --worker and no --model; the
worker, given the coordinator's address, registers once its engine is ready (with its pool
labels and model fingerprint), a text prompt is served with the tokenizer of the model it
registered, a restarted coordinator knows it again within one lease interval, and SIGTERM
deregisters it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from protos.spotinfer.v1 import common_pb2, control_pb2
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.worker_process import WorkerProcess, free_port
from tests.coordinator.conftest import WORKER_FLAGS, assemble, status_of, wait_for_health
from tests.support.wait import wait_until

LEASE_INTERVAL_SECONDS = 1.0
LEASE_TTL_SECONDS = 4.0
HEARTBEAT_SECONDS = 0.5
# One registration round trip on a loaded machine.
ROUND_TRIP_SLACK_SECONDS = 1.0


def _coordinator(port: int, log_dir: Path) -> CoordinatorProcess:
    return CoordinatorProcess(
        *("--heartbeat-interval-seconds", str(HEARTBEAT_SECONDS)),
        log_dir=log_dir,
        port=port,
    ).start()


def _workers(process: CoordinatorProcess) -> list[control_pb2.WorkerInfo]:
    return list(process.control.ListWorkers(control_pb2.ListWorkersRequest(), timeout=10).workers)


def _ready(process: CoordinatorProcess) -> control_pb2.WorkerInfo | None:
    return next((w for w in _workers(process) if w.state == control_pb2.WORKER_STATE_READY), None)


@pytest.fixture
def fleet(tiny_model: Path, tmp_path: Path) -> Iterator[tuple[CoordinatorProcess, WorkerProcess]]:
    port = free_port()
    coordinator = _coordinator(port, tmp_path / "coordinator-1")
    worker = WorkerProcess(
        tiny_model,
        *WORKER_FLAGS,
        *("--worker-id", "joiner"),
        *("--coordinator", f"127.0.0.1:{port}"),
        *("--lease-interval-seconds", str(LEASE_INTERVAL_SECONDS)),
        *("--lease-ttl-seconds", str(LEASE_TTL_SECONDS)),
        *("--cloud", "local", "--zone", "loopback-a", "--instance-type", "cpu", "--spot"),
        log_dir=tmp_path,
    )
    processes = [coordinator, worker]
    try:
        worker.start()
        yield coordinator, worker
    finally:
        for process in processes:
            process.stop()


def test_a_worker_joins_serves_is_relearnt_and_leaves(
    fleet: tuple[CoordinatorProcess, WorkerProcess], tmp_path: Path
) -> None:
    coordinator, worker = fleet
    wait_until(lambda: _ready(coordinator), "the worker registered by itself and READY", 60, 0.2)
    info = _ready(coordinator)
    assert info is not None
    assert info.worker_id == "joiner" and info.address == worker.address
    assert (info.pool.cloud, info.pool.zone, info.pool.instance_type, info.pool.spot) == (
        "local",
        "loopback-a",
        "cpu",
        True,
    )
    assert len(info.model_fingerprint) == 32 and 0 < info.lease_expires_in_seconds <= 4.0
    wait_for_health(coordinator, health_pb2.HealthCheckResponse.SERVING)

    # Another model is refused over the wire, both fingerprints named.
    other = "0" * 32
    with pytest.raises(grpc.RpcError) as refused:
        coordinator.control.RegisterWorker(
            control_pb2.RegisterWorkerRequest(
                address=f"127.0.0.1:{free_port()}", model_fingerprint=other, lease_ttl_seconds=4
            ),
            timeout=10,
        )
    assert status_of(refused.value) == grpc.StatusCode.FAILED_PRECONDITION
    assert other in refused.value.details() and info.model_fingerprint in refused.value.details()  # type: ignore[attr-defined]

    # A text prompt: this coordinator has no --model, so the tokenizer is the registered one.
    request = common_pb2.GenerateRequest(
        prompt="The capital of France is",
        sampling=common_pb2.SamplingParams(max_tokens=6, ignore_eos=True),
    )
    responses = list(coordinator.inference.Generate(request, timeout=120))
    assert len(assemble(responses)) == 6
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert {r.worker_id for r in responses} == {"joiner"}

    # A restarted coordinator (same port, no flags naming workers) hears the next renewal.
    port = coordinator.port
    coordinator.stop()
    coordinator = _coordinator(port, tmp_path / "coordinator-2")
    restarted_at = time.monotonic()  # listening from here
    try:
        wait_until(
            lambda: any(w.worker_id == "joiner" for w in _workers(coordinator)),
            "the restarted coordinator knows the worker",
            LEASE_INTERVAL_SECONDS * 10,
            0.05,
        )
        relearnt_seconds = time.monotonic() - restarted_at
        assert relearnt_seconds < LEASE_INTERVAL_SECONDS + ROUND_TRIP_SLACK_SECONDS, (
            relearnt_seconds
        )
        wait_until(lambda: _ready(coordinator), "the worker READY again", 30, 0.1)

        # A clean stop deregisters: the coordinator says STOPPED at once, not LOST later.
        assert worker.terminate() == 0
        states = {w.worker_id: w.state for w in _workers(coordinator)}
        assert states["joiner"] == control_pb2.WORKER_STATE_STOPPED, states
    finally:
        coordinator.stop()
