"""The cluster's KV persistence policy: each worker's registration and Stats carry its policy
and hybrid cap, the coordinator shows them per worker and for the cluster (ListWorkers,
ClusterStatus, `spotinfer status`, its /metrics), and when the workers of one cluster
disagree it says so: a warning in its log, in the status and in a metric.

A real coordinator process; the workers are stand-ins serving the Worker service's Stats on
loopback (the coordinator asks nothing else of a worker that runs no request), so a test can
change what a worker reports between two heartbeats."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from common.messages import KvPersistence
from protos.convert import kv_persistence_to_proto
from protos.spotinfer.v1 import control_pb2, worker_pb2, worker_pb2_grpc
from spotinfer.cli import main as spotinfer_main
from spotinfer.local.coordinator_process import CoordinatorProcess
from tests.coordinator.conftest import start_coordinator
from tests.metrics.scrape import scrape
from tests.support.wait import wait_until

HYBRID = KvPersistence("hybrid", 2_000_000.0)
EAGER = KvPersistence("eager")


class StandInWorker(worker_pb2_grpc.WorkerServicer):
    """Answers Stats as a ready, idle worker applying ``persistence`` (changeable)."""

    def __init__(self, worker_id: str, persistence: KvPersistence) -> None:
        self.worker_id = worker_id
        self.persistence = persistence
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self._server.start()

    def stats_message(self) -> worker_pb2.WorkerStats:
        with self._lock:
            persistence = self.persistence
        return worker_pb2.WorkerStats(
            worker_id=self.worker_id,
            ready=True,
            kv_blocks_total=100,
            kv_blocks_free=100,
            kv_block_tokens=16,
            max_num_seqs=4,
            max_model_len=1024,
            model="tiny",
            kv_persistence=kv_persistence_to_proto(persistence),
        )

    def Stats(  # noqa: N802
        self, request: worker_pb2.StatsRequest, context: grpc.ServicerContext
    ) -> worker_pb2.WorkerStats:
        return self.stats_message()

    def report(self, persistence: KvPersistence) -> None:
        with self._lock:
            self.persistence = persistence

    def stop(self) -> None:
        self._server.stop(0)


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    process = start_coordinator(log_dir=tmp_path, wait_serving=False)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def stand_ins() -> Iterator[list[StandInWorker]]:
    workers = [StandInWorker("w-a", HYBRID), StandInWorker("w-b", HYBRID)]
    try:
        yield workers
    finally:
        for worker in workers:
            worker.stop()


def _register(coordinator: CoordinatorProcess, worker: StandInWorker) -> None:
    """As a launcher would, with the capacity (and so the policy) a worker's own sends."""
    coordinator.control.RegisterWorker(
        control_pb2.RegisterWorkerRequest(
            worker_id=worker.worker_id, address=worker.address, capacity=worker.stats_message()
        ),
        timeout=10,
    )


def _status(coordinator: CoordinatorProcess) -> control_pb2.ClusterStatusResponse:
    return coordinator.control.ClusterStatus(control_pb2.ClusterStatusRequest(), timeout=10)


def _status_text(coordinator: CoordinatorProcess, capsys: pytest.CaptureFixture[str]) -> str:
    """What `spotinfer status` prints, whitespace folded (the console wraps long lines)."""
    capsys.readouterr()
    assert spotinfer_main(["status", "--target", coordinator.address]) == 0
    return " ".join(capsys.readouterr().out.split())


def test_the_cluster_policy_is_shown_and_a_disagreement_is_warned_about(
    coordinator: CoordinatorProcess,
    stand_ins: list[StandInWorker],
    capsys: pytest.CaptureFixture[str],
) -> None:
    second = stand_ins[1]
    for worker in stand_ins:
        _register(coordinator, worker)
    listed = coordinator.control.ListWorkers(control_pb2.ListWorkersRequest(), timeout=10)
    assert {w.worker_id: w.stats.kv_persistence for w in listed.workers} == {
        "w-a": kv_persistence_to_proto(HYBRID),
        "w-b": kv_persistence_to_proto(HYBRID),
    }
    status = _status(coordinator)
    assert status.kv_persistence == kv_persistence_to_proto(HYBRID)
    assert status.kv_persistence_warning == ""
    printed = _status_text(coordinator, capsys)
    assert "KV persistence: hybrid 2 MB/s" in printed
    assert "warning" not in printed

    second.report(EAGER)  # restarted with another policy: its next Stats says so
    wait_until(lambda: _status(coordinator).kv_persistence_warning, "the disagreement seen", 20)
    status = _status(coordinator)
    assert not status.kv_persistence.policy, "no cluster policy while the workers disagree"
    assert status.kv_persistence_warning == (
        "the workers disagree on the KV persistence policy (eager: w-b; hybrid 2 MB/s: w-a)"
    )
    assert "warning: the workers disagree on the KV persistence policy" in _status_text(
        coordinator, capsys
    )
    wait_until(
        lambda: "disagree on the KV persistence policy" in coordinator.output,
        "the warning in the coordinator's log",
        20,
    )
    metrics = scrape(coordinator.http_url + "/metrics")
    assert metrics.value("spotinfer_coordinator_kv_persist_policies_disagree") == 1
    assert metrics.value("spotinfer_coordinator_kv_persist_policy_workers", policy="eager") == 1
    assert metrics.value("spotinfer_coordinator_kv_persist_policy_workers", policy="hybrid") == 1

    second.report(HYBRID)
    wait_until(lambda: not _status(coordinator).kv_persistence_warning, "agreement again", 20)
    assert _status(coordinator).kv_persistence == kv_persistence_to_proto(HYBRID)
    wait_until(
        lambda: "agree on the KV persistence policy again: hybrid 2 MB/s" in coordinator.output,
        "the coordinator logs the agreement",
        20,
    )
