"""Health follows readiness; SIGTERM drains: no new requests, in-flight ones finish, exit 0."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from protos.spotinfer.v1 import common_pb2, worker_pb2
from spotinfer.local.worker_process import WorkerProcess
from tests.support.wait import wait_until

FLAGS = ("--dtype", "float32", "--max-model-len", "1024", "--kv-cache-bytes", str(32 << 20))


def test_not_serving_until_the_engine_is_ready(tiny_model: Path, tmp_path: Path) -> None:
    process = WorkerProcess(tiny_model, *FLAGS, log_dir=tmp_path).start(wait_ready=False)
    try:
        statuses: list[int] = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                statuses.append(process.health())
            except grpc.RpcError:
                time.sleep(0.05)  # not listening yet
                continue
            if statuses[-1] == health_pb2.HealthCheckResponse.SERVING:
                break
            time.sleep(0.05)
        assert statuses[0] == health_pb2.HealthCheckResponse.NOT_SERVING
        assert statuses[-1] == health_pb2.HealthCheckResponse.SERVING
        # Its "ready" line is printed as it starts serving; the output pump may read it a
        # moment after the health check saw SERVING.
        wait_until(lambda: "ready" in process.output, "the worker's ready line", timeout=30)
    finally:
        process.stop()


def test_sigterm_drains_in_flight_requests(tiny_model: Path, tmp_path: Path) -> None:
    process = WorkerProcess(tiny_model, *FLAGS, "--drain-grace-seconds", "120", log_dir=tmp_path)
    process.start()
    try:
        stream = process.stub.Generate(
            common_pb2.GenerateRequest(
                request_id="long",
                prompt="The morning train",
                sampling=common_pb2.SamplingParams(max_tokens=300, ignore_eos=True),
            ),
            timeout=300,
        )
        first = next(stream)
        collected = [first]
        reader = threading.Thread(target=lambda: collected.extend(stream))
        reader.start()
        assert process.process is not None
        process.process.send_signal(15)
        time.sleep(1.0)
        with pytest.raises(grpc.RpcError) as caught:
            list(
                process.stub.Generate(
                    common_pb2.GenerateRequest(
                        prompt="late", sampling=common_pb2.SamplingParams(max_tokens=2)
                    ),
                    timeout=10,
                )
            )
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        reader.join(300)
        assert sum(len(r.token_ids) for r in collected) == 300, "the in-flight request finishes"
        assert collected[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert process.process.wait(120) == 0
    finally:
        process.kill()


def test_drain_rpc_cuts_requests_at_the_grace_limit(tiny_model: Path, tmp_path: Path) -> None:
    with WorkerProcess(tiny_model, *FLAGS, log_dir=tmp_path) as process:
        stream = process.stub.Generate(
            common_pb2.GenerateRequest(
                prompt="The library",
                sampling=common_pb2.SamplingParams(max_tokens=900, ignore_eos=True),
            ),
            timeout=300,
        )
        next(stream)
        reply = process.stub.Drain(worker_pb2.DrainRequest(grace_seconds=0.5), timeout=10)
        assert reply.in_flight == 1
        rest = list(stream)
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_CANCELLED
        stats = process.stub.Stats(worker_pb2.StatsRequest(), timeout=10)
        assert stats.draining and not stats.ready
        assert process.health() == health_pb2.HealthCheckResponse.NOT_SERVING
