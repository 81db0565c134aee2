"""A pause wastes no decode step: the step in flight when the notice lands finishes, and its
token reaches the client before the NOTICE, instead of being computed and thrown away (what
vLLM's eager abort does). Observable without timing: every step the request ran — the
worker's batch-size histogram sums the requests of each step — gave the client one token.
"""

from __future__ import annotations

import time
from pathlib import Path

from protos.spotinfer.v1 import common_pb2, worker_pb2
from spotinfer.local.worker_process import WorkerProcess
from store import RedisStore, RequestStatus
from tests.metrics.scrape import scrape
from tests.notice.conftest import worker_flags
from tests.resume.streams import (
    STREAM_TIMEOUT_SECONDS,
    StreamReader,
    generate,
    greedy_request,
    resume_stream,
)
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until

PROMPT = [5 + (11 * j) % 490 for j in range(150)]  # a full block and a partial one
MAX_TOKENS = 800
TOKENS_BEFORE_NOTICE = 60
NOTICE_SECONDS = 20.0


def _request_steps(worker: WorkerProcess) -> float:
    """Sum of spotinfer_worker_batch_size: requests run, over every engine step so far."""
    metrics = scrape(worker.metrics_url)
    assert metrics.has("spotinfer_worker_batch_size_sum"), "no batch-size histogram"
    return metrics.value("spotinfer_worker_batch_size_sum")


def test_the_step_in_flight_at_a_pause_reaches_the_client(
    tiny_model: Path,
    redis_server: RedisServer,
    standby: WorkerProcess,
    store: RedisStore,
    tmp_path: Path,
) -> None:
    request_id = "boundary-pause"
    with WorkerProcess(
        tiny_model,
        *worker_flags(redis_server.url, "eager"),
        *("--worker-id", "worker-boundary"),
        log_dir=tmp_path,
        metrics=True,
    ) as worker:
        assert _request_steps(worker) == 0, "the worker ran steps before the test's request"
        reader = StreamReader(
            worker.stub.Generate(
                greedy_request(request_id, PROMPT, MAX_TOKENS), timeout=STREAM_TIMEOUT_SECONDS
            )
        )
        wait_until(
            lambda: reader.done or len(reader.tokens()) >= TOKENS_BEFORE_NOTICE, "tokens flowing"
        )
        progress = list(
            worker.stub.Preempt(
                worker_pb2.PreemptRequest(deadline_unix=time.time() + NOTICE_SECONDS), timeout=60
            )
        )
        reader.join()
        received = reader.tokens()
        assert reader.error is None and reader.responses[-1].event.kind == (
            common_pb2.EVENT_KIND_NOTICE
        )
        assert TOKENS_BEFORE_NOTICE <= len(received) < MAX_TOKENS, "the pause must cut it"
        (report,) = progress
        assert report.complete and report.committed_tokens == len(received), report
        # The prefill step gave token 0 and each decode step one more: as many request-steps
        # as tokens, none computed for nothing.
        wait_until(lambda: _request_steps(worker) >= len(received), "the step stats")
        assert _request_steps(worker) == len(received)
    assert store.get_request(request_id).status == RequestStatus.PAUSED

    event, rest = resume_stream(standby, request_id, len(received))
    assert event.kind == common_pb2.EVENT_KIND_MIGRATED and event.recomputed_tokens == 0, event
    reference = generate(standby, greedy_request(f"{request_id}-reference", PROMPT, MAX_TOKENS))
    assert received + rest == reference
