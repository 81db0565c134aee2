"""Every process serves /metrics in Prometheus text format, and the numbers move as requests
flow: a real coordinator in front of a real worker (tiny model, Redis persistence) with its
context daemon, each scraped over HTTP and parsed by `prometheus_client`'s parser."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from protos.spotinfer.v1 import common_pb2
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.daemon_process import DaemonProcess
from spotinfer.local.worker_process import WorkerProcess
from tests.coordinator.conftest import assemble, greedy, start_coordinator
from tests.metrics.scrape import Scrape, scrape
from tests.support.redis_server import RedisServer
from worker.constants import DEFAULT_KV_CHUNK_TOKENS

PROMPT_IDS = [7, 11, 13, 17, 19, 23, 29, 31] * 5  # 40 tokens
MAX_TOKENS = 600  # prompt + output spans 5 KV blocks of 128 tokens: blocks get persisted
REQUESTS = 4
WAIT_SECONDS = 60.0
WORKER_FLAGS = ("--dtype", "float32", "--max-model-len", "1024", "--memory-gib", "0.25")


@dataclass
class Cluster:
    coordinator: CoordinatorProcess
    worker: WorkerProcess
    daemon: DaemonProcess
    notice_file: Path

    @property
    def coordinator_metrics_url(self) -> str:
        return self.coordinator.http_url + "/metrics"


@pytest.fixture(scope="module")
def cluster(
    tiny_model: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("metrics-logs")
    notice_file = log_dir / "notice.json"
    with ExitStack() as stack:
        worker = stack.enter_context(
            WorkerProcess(
                tiny_model,
                *WORKER_FLAGS,
                "--redis-url",
                redis_server.url,
                "--worker-id",
                "metrics-w0",
                log_dir=log_dir,
                metrics=True,
            )
        )
        daemon = stack.enter_context(
            DaemonProcess(
                "--notice-source",
                "file",
                "--notice-file",
                str(notice_file),
                "--grace-seconds",
                "30",
                "--poll-interval-seconds",
                "0.2",
                "--worker-address",
                worker.address,
                "--redis-url",
                redis_server.url,
                log_dir=log_dir,
                metrics=True,
            )
        )
        coordinator = start_coordinator(
            "--worker", worker.address, "--model", str(tiny_model), log_dir=log_dir
        )
        stack.callback(coordinator.stop)
        yield Cluster(coordinator, worker, daemon, notice_file)


def _run_requests(cluster: Cluster) -> list[list[int]]:
    def one(i: int) -> list[int]:
        responses = list(
            cluster.coordinator.inference.Generate(
                greedy(PROMPT_IDS, MAX_TOKENS, f"metrics-{i}"), timeout=WAIT_SECONDS
            )
        )
        return assemble(responses)

    with ThreadPoolExecutor(REQUESTS) as pool:
        return list(pool.map(one, range(REQUESTS)))


def _sample_worker_while(cluster: Cluster, done: threading.Event) -> list[Scrape]:
    scrapes = []
    while not done.is_set():
        scrapes.append(scrape(cluster.worker.metrics_url))
        time.sleep(0.05)
    return scrapes


def test_every_process_serves_parseable_metrics(cluster: Cluster) -> None:
    coordinator = scrape(cluster.coordinator_metrics_url)
    worker = scrape(cluster.worker.metrics_url)
    daemon = scrape(cluster.daemon.metrics_url)
    assert coordinator.has("spotinfer_coordinator_queue_depth")
    assert worker.value("spotinfer_worker_kv_blocks_total") > 0
    assert worker.value("spotinfer_worker_kv_headroom_ratio") == 1.0
    assert daemon.value("spotinfer_daemon_store_available") == 1.0
    assert daemon.value("spotinfer_daemon_flushes_total") == 0.0
    assert worker.types["spotinfer_worker_batch_size"] == "histogram"


def test_counters_move_as_requests_flow(cluster: Cluster) -> None:
    before = {
        "coordinator": scrape(cluster.coordinator_metrics_url),
        "worker": scrape(cluster.worker.metrics_url),
    }
    done = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        sampling = pool.submit(_sample_worker_while, cluster, done)
        try:
            outputs = _run_requests(cluster)
        finally:
            done.set()
        during = sampling.result()
    assert [len(tokens) for tokens in outputs] == [MAX_TOKENS] * REQUESTS

    # KV in use and sequences running while the requests ran.
    assert max(s.value("spotinfer_worker_kv_blocks_used") for s in during) > 0
    assert max(s.value("spotinfer_worker_running_seqs") for s in during) > 0
    assert max(s.value("spotinfer_worker_tokens_per_second") for s in during) > 0

    coordinator = scrape(cluster.coordinator_metrics_url)
    c0 = before["coordinator"]
    finished = "spotinfer_coordinator_requests_total"
    labels = {"sla_class": "INTERACTIVE", "finish_reason": "LENGTH"}
    assert coordinator.value(finished, **labels) - c0.value(finished, **labels) == REQUESTS
    relayed = "spotinfer_coordinator_tokens_relayed_total"
    assert coordinator.value(relayed) - c0.value(relayed) == REQUESTS * MAX_TOKENS
    ttft = "spotinfer_coordinator_time_to_first_token_seconds_count"
    assert coordinator.value(ttft) - c0.value(ttft) == REQUESTS

    # The last KV blocks are reported with the engine step after their write: wait for them.
    deadline = time.monotonic() + WAIT_SECONDS
    w0 = before["worker"]
    worker = scrape(cluster.worker.metrics_url)
    # Persisted in chunks (one stored value per DEFAULT_KV_CHUNK_TOKENS filled tokens).
    full_blocks = REQUESTS * ((len(PROMPT_IDS) + MAX_TOKENS - 1) // DEFAULT_KV_CHUNK_TOKENS)
    while (
        worker.value("spotinfer_worker_kv_persisted_blocks_total") < full_blocks
        and time.monotonic() < deadline
    ):
        # A one-token request is one more engine step, which carries the writer's report.
        list(cluster.worker.stub.Generate(greedy([5, 6], 1), timeout=WAIT_SECONDS))
        worker = scrape(cluster.worker.metrics_url)

    generated = "spotinfer_worker_generated_tokens_total"
    assert worker.value(generated) - w0.value(generated) >= REQUESTS * MAX_TOKENS
    steps = "spotinfer_worker_batch_size_count"
    batched = "spotinfer_worker_batch_size_sum"
    assert worker.value(steps) - w0.value(steps) >= MAX_TOKENS
    # Every generated token came out of some step's batch.
    assert worker.value(batched) - w0.value(batched) >= REQUESTS * MAX_TOKENS
    # Four requests ran together: some step's batch held more than one.
    above_one = worker.value(steps) - worker.value("spotinfer_worker_batch_size_bucket", le="1.0")
    assert above_one > 0
    generate_ttft = "spotinfer_worker_time_to_first_token_seconds_count"
    assert (
        worker.value(generate_ttft, path="generate") - w0.value(generate_ttft, path="generate")
        >= REQUESTS
    )
    tpot = "spotinfer_worker_time_per_output_token_seconds_count"
    assert worker.value(tpot, path="generate") - w0.value(tpot, path="generate") >= REQUESTS
    commits = "spotinfer_worker_token_commit_seconds_count"
    assert worker.value(commits) - w0.value(commits) > 0
    assert worker.value("spotinfer_worker_kv_persisted_blocks_total") >= full_blocks
    block_bytes = 128 * 1024  # 128 tokens x 2 layers x 2 (K, V) x 2 heads x 32 dims x fp32
    assert worker.value("spotinfer_worker_kv_persisted_bytes_total") >= full_blocks * block_bytes
    assert worker.value("spotinfer_worker_vllm_preemptions_total") == 0
    assert worker.value("spotinfer_worker_kv_blocks_used") == 0  # all finished

    # Energy per token is present, with its source; an estimate says so.
    energy = worker.labels_of("spotinfer_worker_energy_per_token_joules")
    assert len(energy) == 1
    source = energy[0]["source"]
    assert source in ("cpu-time-estimate", "nvml")
    assert worker.value("spotinfer_worker_energy_per_token_joules") > 0
    help_text = worker.families["spotinfer_worker_energy_per_token_joules"]
    assert ("estimate" in help_text) == (source == "cpu-time-estimate")


def test_a_notice_moves_the_daemon_and_worker_counters(cluster: Cluster) -> None:
    """Last in this module: the notice pauses the worker for good."""
    worker_before = scrape(cluster.worker.metrics_url)
    stream = cluster.worker.stub.Generate(greedy(PROMPT_IDS, 900, "paused-by-notice"), timeout=120)
    next(stream)  # it runs now
    cluster.notice_file.write_text('{"action": "terminate"}')
    responses = list(stream)
    events = [r.event.kind for r in responses if r.HasField("event")]
    assert common_pb2.EVENT_KIND_NOTICE in events

    deadline = time.monotonic() + WAIT_SECONDS
    daemon = scrape(cluster.daemon.metrics_url)
    while (
        daemon.value("spotinfer_daemon_flushed_requests_total") < 1 and time.monotonic() < deadline
    ):
        time.sleep(0.1)
        daemon = scrape(cluster.daemon.metrics_url)
    assert daemon.value("spotinfer_daemon_notices_total", source="file", action="terminate") == 1
    assert daemon.value("spotinfer_daemon_flushes_total") == 1
    assert daemon.value("spotinfer_daemon_flushed_requests_total", outcome="complete") == 1
    assert daemon.value("spotinfer_daemon_flushed_requests_total", outcome="incomplete") == 0
    assert 0 < daemon.value("spotinfer_daemon_deadline_seconds_left") <= 30

    worker = scrape(cluster.worker.metrics_url)
    notices = "spotinfer_worker_preempt_notices_total"
    assert worker.value(notices) - worker_before.value(notices) == 1
    paused = "spotinfer_worker_paused_requests_total"
    assert worker.value(paused) - worker_before.value(paused) == 1
