"""Real processes for the coordinator tests: two workers on the tiny model, shared by the whole
package, and coordinators in front of them (one shared, others per test module)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.spotinfer.v1 import common_pb2
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.worker_process import WorkerProcess
from tests.support.wait import wait_until

# float32: outputs are compared token for token (bf16 CPU kernels depend on the batch size).
WORKER_FLAGS = ("--dtype", "float32", "--max-model-len", "1024", "--memory-gib", "0.25")
TIMEOUT_SECONDS = 120


@contextlib.contextmanager
def started_workers(
    tiny_model: Path, names: Sequence[str], log_dir: Path, *flags: str
) -> Iterator[list[WorkerProcess]]:
    """One worker per name (WORKER_FLAGS and ``flags``), loaded in parallel, all stopped at
    the end (also when one fails to start)."""
    processes = [
        WorkerProcess(tiny_model, *WORKER_FLAGS, *flags, "--worker-id", name, log_dir=log_dir)
        for name in names
    ]
    try:
        with ThreadPoolExecutor(len(processes)) as pool:
            list(pool.map(lambda p: p.start(), processes))
        yield processes
    finally:
        for process in processes:
            if process.process is not None:
                process.stop()


@pytest.fixture(scope="package")
def workers(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[WorkerProcess]]:
    log_dir = tmp_path_factory.mktemp("worker-logs")
    with started_workers(tiny_model, ["w0", "w1"], log_dir) as processes:
        yield processes


@pytest.fixture(scope="package")
def coordinator(
    workers: list[WorkerProcess], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CoordinatorProcess]:
    """The shared coordinator in front of both workers (defaults otherwise)."""
    flags = [f for w in workers for f in ("--worker", w.address)]
    process = start_coordinator(
        *flags, "--model", str(tiny_model), log_dir=tmp_path_factory.mktemp("coordinator-logs")
    )
    try:
        yield process
    finally:
        process.stop()


def start_coordinator(*flags: str, log_dir: Path, wait_serving: bool = True) -> CoordinatorProcess:
    """A coordinator with ``flags``; a test that names no failover policy gets ``fail`` (the
    one these tests were written for: a broken stream ends, nothing moves)."""
    if "--failover-policy" not in flags:
        flags = ("--failover-policy", "fail", *flags)
    process = CoordinatorProcess(*flags, "--heartbeat-interval-seconds", "0.5", log_dir=log_dir)
    process.start()
    if wait_serving:
        try:
            wait_for_health(process, health_pb2.HealthCheckResponse.SERVING)
        except BaseException:
            process.stop()
            raise
    return process


def health_of(process: CoordinatorProcess) -> int:
    assert process.channel is not None
    stub = health_pb2_grpc.HealthStub(process.channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status)


def wait_for_health(process: CoordinatorProcess, status: int, timeout: float = 60.0) -> None:
    """Polls health until it reads ``status`` (a worker becomes ready within a heartbeat)."""
    wait_until(
        lambda: health_of(process) == status,
        lambda: f"coordinator health {status}; its output:\n{process.output[-3000:]}",
        timeout,
        0.1,
    )


def greedy(
    prompt_ids: list[int], max_tokens: int, request_id: str = "", **fields: object
) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        **fields,  # type: ignore[arg-type]
    )


def assemble(responses: list[common_pb2.GenerateResponse]) -> list[int]:
    """The output tokens, checking that every index arrives once, in order, from 0."""
    tokens: list[int] = []
    for response in responses:
        assert response.index == len(tokens), (
            f"index {response.index} where {len(tokens)} was expected"
        )
        tokens.extend(response.token_ids)
    return tokens


def status_of(call: object) -> grpc.StatusCode:
    assert isinstance(call, grpc.RpcError)
    return call.code()  # type: ignore[no-any-return, attr-defined]
