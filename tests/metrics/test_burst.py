"""A burst of ten times the cluster's capacity at once: admission queues what fits and sheds
the rest with RESOURCE_EXHAUSTED and a retry hint; nothing is lost without an answer, every
accepted request completes exactly once, and the worker never runs out of KV memory.

The worker's KV cache is made small on purpose: 12 blocks, while every request grows to 2.
Without the coordinator's caps vLLM would admit the burst and then preempt requests when their
second block is not there; with them, at most 5 run, holding at most 10 blocks.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from common.channels import async_channel
from protos.spotinfer.v1 import common_pb2, inference_pb2_grpc, worker_pb2
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.worker_process import WorkerProcess
from tests.coordinator.conftest import assemble, greedy, start_coordinator
from tests.metrics.scrape import scrape

BLOCK_TOKENS = 128  # vLLM's KV block on CPU
BLOCK_BYTES = BLOCK_TOKENS * 1024  # tiny model in fp32: 2 layers x K,V x 2 heads x 32 dims x 4 B
KV_BLOCKS = 12
PROMPT_IDS = list(range(10, 110))  # 100 tokens: one block at admission ...
MAX_TOKENS = 100  # ... and a second one while decoding
MAX_SEQS_PER_WORKER = 5
INTERACTIVE_CAP, BATCH_CAP = 3, 2
INTERACTIVE_QUEUE, BATCH_QUEUE = 3, 3
CAPACITY = MAX_SEQS_PER_WORKER + INTERACTIVE_QUEUE + BATCH_QUEUE
BURST = 10 * CAPACITY
RETRY_AFTER_MS = 200
REQUEST_TIMEOUT_SECONDS = 300.0


@dataclass(frozen=True)
class Outcome:
    request_id: str
    tokens: list[int] | None  # the whole output when it completed
    code: grpc.StatusCode | None  # the error otherwise
    retry_after_ms: str | None


@pytest.fixture(scope="module")
def worker(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    with WorkerProcess(
        tiny_model,
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--kv-cache-bytes",
        str(KV_BLOCKS * BLOCK_BYTES),
        "--worker-id",
        "burst-w0",
        log_dir=tmp_path_factory.mktemp("burst-worker-logs"),
        metrics=True,
    ) as process:
        yield process


@pytest.fixture(scope="module")
def coordinator(
    worker: WorkerProcess, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CoordinatorProcess]:
    process = start_coordinator(
        "--worker",
        worker.address,
        "--model",
        str(tiny_model),
        "--max-seqs-per-worker",
        str(MAX_SEQS_PER_WORKER),
        "--interactive-max-per-worker",
        str(INTERACTIVE_CAP),
        "--batch-max-per-worker",
        str(BATCH_CAP),
        "--interactive-queue-capacity",
        str(INTERACTIVE_QUEUE),
        "--batch-queue-capacity",
        str(BATCH_QUEUE),
        "--retry-after-ms",
        str(RETRY_AFTER_MS),
        log_dir=tmp_path_factory.mktemp("burst-coordinator-logs"),
    )
    yield process
    process.stop()


async def _one(stub: inference_pb2_grpc.InferenceStub, request_id: str, sla: int) -> Outcome:
    call = stub.Generate(
        greedy(PROMPT_IDS, MAX_TOKENS, request_id, sla_class=sla), timeout=REQUEST_TIMEOUT_SECONDS
    )
    try:
        responses = [response async for response in call]
    except grpc.aio.AioRpcError as error:
        trailing = dict(error.trailing_metadata() or ())
        hint = trailing.get("retry-after-ms")
        return Outcome(request_id, None, error.code(), str(hint) if hint is not None else None)
    return Outcome(request_id, assemble(responses), None, None)


async def _burst(address: str) -> list[Outcome]:
    """Every request in flight at once, from its own call (half INTERACTIVE, half BATCH)."""
    async with async_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        classes = (common_pb2.SLA_CLASS_INTERACTIVE, common_pb2.SLA_CLASS_BATCH)
        return list(
            await asyncio.gather(*(_one(stub, f"burst-{i}", classes[i % 2]) for i in range(BURST)))
        )


def _watch_worker(worker: WorkerProcess, stop: threading.Event) -> list[worker_pb2.WorkerStats]:
    samples = []
    while not stop.is_set():
        samples.append(worker.stub.Stats(worker_pb2.StatsRequest(), timeout=10))
        time.sleep(0.01)
    return samples


def test_a_ten_fold_burst_queues_then_sheds_and_never_exhausts_kv(
    coordinator: CoordinatorProcess, worker: WorkerProcess
) -> None:
    metrics_url = coordinator.http_url + "/metrics"
    before = scrape(metrics_url)
    stop = threading.Event()
    samples: list[worker_pb2.WorkerStats] = []
    watcher = threading.Thread(target=lambda: samples.extend(_watch_worker(worker, stop)))
    watcher.start()
    try:
        outcomes = asyncio.run(_burst(coordinator.address))
    finally:
        stop.set()
        watcher.join()

    # Every request has exactly one of two outcomes; none vanished.
    assert len(outcomes) == BURST
    completed = [o for o in outcomes if o.tokens is not None]
    shed = [o for o in outcomes if o.tokens is None]
    for outcome in completed:
        assert len(outcome.tokens or []) == MAX_TOKENS, outcome.request_id
    for outcome in shed:
        assert outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (outcome.request_id, outcome)
        assert outcome.retry_after_ms is not None, outcome.request_id
        assert int(outcome.retry_after_ms) >= RETRY_AFTER_MS
    # What fits was accepted (the first CAPACITY arrivals find a slot or a queue place) ...
    assert len(completed) >= CAPACITY
    # ... and a burst ten times that size had to be shed in part.
    assert len(shed) > 0

    # The coordinator's books agree with what the clients saw.
    after = scrape(metrics_url)
    rejected = "spotinfer_coordinator_rejected_requests_total"
    assert after.value(rejected, reason="queue_full") - before.value(
        rejected, reason="queue_full"
    ) == len(shed)
    finished = "spotinfer_coordinator_requests_total"
    assert after.value(finished, finish_reason="LENGTH") - before.value(
        finished, finish_reason="LENGTH"
    ) == len(completed)
    assert after.value("spotinfer_coordinator_requests_in_flight") == 0

    # The worker never ran more than the cap, never ran out of KV blocks, never preempted.
    running = [s for s in samples if s.running_seqs > 0]
    assert running, "the watcher never saw the burst running"
    assert max(s.running_seqs for s in samples) <= MAX_SEQS_PER_WORKER
    assert min(s.kv_blocks_free for s in samples) > 0
    assert samples[0].kv_blocks_total == KV_BLOCKS
    worker_metrics = scrape(worker.metrics_url)
    assert worker_metrics.value("spotinfer_worker_vllm_preemptions_total") == 0
    assert worker_metrics.value("spotinfer_worker_batch_size_count") > 0
    steps = worker_metrics.value("spotinfer_worker_batch_size_count")
    assert worker_metrics.value("spotinfer_worker_batch_size_bucket", le="8.0") == steps

    # Still healthy, and still serving.
    assert worker.process is not None and worker.process.poll() is None
    assert worker.health() == health_pb2.HealthCheckResponse.SERVING
    again = list(coordinator.inference.Generate(greedy(PROMPT_IDS, 8), timeout=60))
    assert len(assemble(again)) == 8
