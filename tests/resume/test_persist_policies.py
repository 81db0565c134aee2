"""The hybrid KV persistence policy on a real engine: with a tiny rate cap, fewer of a
request's blocks are in Redis mid-stream than under eager (the first chunk only: a resume
can use a stored prefix); a notice (Preempt) then saves every held-back block and the tail,
and the standby resumes the request with nothing recomputed. The worker's metrics say which
policy it applies, its cap and the blocks the cap held back.

Real processes: the package's redis-server and standby B (eager), and worker A (hybrid)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from protos.spotinfer.v1 import common_pb2, worker_pb2
from spotinfer.local.worker_process import WorkerProcess
from store import RedisStore, block_hashes
from tests.metrics.scrape import scrape
from tests.resume.conftest import BLOCK_TOKENS, worker_flags
from tests.resume.streams import STREAM_TIMEOUT_SECONDS, StreamReader, greedy_request, resume_stream
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until
from worker.model_fingerprint import model_fingerprint

PROMPT_TOKENS = 300
MAX_TOKENS = 700
# Mid-stream: 100 tokens past the second chunk's end, long after eager stored it.
MID_STREAM_TOKENS = 2 * BLOCK_TOKENS + 100 - PROMPT_TOKENS
# 0.001 MB/s: a tiny-model chunk (256 tokens × 2 layers × K and V × 2 heads × 32 × 4 bytes,
# 256 KiB) every ~260 s. The bucket starts full, so the first chunk goes at once.
RATE_MB_S = "0.001"


def _prompt(step: int) -> list[int]:
    return [(step * n) % 450 + 40 for n in range(PROMPT_TOKENS)]


def _stored_prefix(store: RedisStore, fingerprint: str, token_ids: Sequence[int]) -> int:
    """How many leading full chunks of ``token_ids`` Redis holds."""
    count = 0
    for present in store.blocks_present(block_hashes(fingerprint, list(token_ids), BLOCK_TOKENS)):
        if not present:
            break
        count += 1
    return count


def _mid_stream(
    worker: WorkerProcess, request_id: str, prompt: list[int]
) -> tuple[StreamReader, list[int]]:
    """The request's stream, once MID_STREAM_TOKENS came; and the context at that point."""
    reader = StreamReader(
        worker.stub.Generate(
            greedy_request(request_id, prompt, MAX_TOKENS), timeout=STREAM_TIMEOUT_SECONDS
        )
    )
    wait_until(
        lambda: len(reader.tokens()) >= MID_STREAM_TOKENS, f"{request_id} mid-stream", 120, 0.01
    )
    return reader, prompt + reader.tokens()[:MID_STREAM_TOKENS]


def test_hybrid_holds_blocks_back_mid_stream_and_a_notice_saves_them_all(
    tiny_model: Path,
    redis_server: RedisServer,
    store: RedisStore,
    standby: WorkerProcess,
    tmp_path: Path,
) -> None:
    fingerprint = model_fingerprint(str(tiny_model), "float32")
    eager_prompt, hybrid_prompt = _prompt(7), _prompt(11)
    eager, eager_context = _mid_stream(standby, "policy-eager", eager_prompt)
    wait_until(
        lambda: _stored_prefix(store, fingerprint, eager_context) == 2,
        "eager: both full chunks in Redis",
    )
    eager.join()

    with WorkerProcess(
        tiny_model,
        *worker_flags(redis_server.url),
        *("--kv-persist-policy", "hybrid", "--kv-persist-rate-mb-s", RATE_MB_S),
        *("--worker-id", "worker-hybrid"),
        log_dir=tmp_path,
        metrics=True,
    ) as worker:
        reader, context = _mid_stream(worker, "policy-hybrid", hybrid_prompt)
        # The first chunk, which the full bucket allowed (written at the prefill, long ago);
        # the second was held back by the cap, not by a slow write (the metric says so).
        stored_mid_stream = _stored_prefix(store, fingerprint, context)
        metrics = scrape(worker.metrics_url)
        flushed = list(
            worker.stub.Preempt(
                worker_pb2.PreemptRequest(deadline_unix=time.time() + 60), timeout=60
            )
        )
        reader.join()
    assert stored_mid_stream == 1
    assert metrics.value("spotinfer_worker_kv_persist_policy", policy="hybrid") == 1
    assert metrics.value("spotinfer_worker_kv_persist_rate_cap_bytes_per_second") == 1000
    assert metrics.value("spotinfer_worker_kv_deferred_blocks_total") >= 1
    paused = [r for r in flushed if r.request_id == "policy-hybrid"]
    assert paused, "the request ended before the notice; the test proves nothing"
    (report,) = paused
    assert report.complete and report.tail_persisted
    context_tokens = report.context_tokens
    assert report.persisted_blocks == (context_tokens - 1) // BLOCK_TOKENS >= 2
    received = reader.tokens()
    assert reader.responses[-1].event.kind == common_pb2.EVENT_KIND_NOTICE

    event, resumed = resume_stream(standby, "policy-hybrid", from_index=len(received))

    assert event.kind == common_pb2.EVENT_KIND_MIGRATED
    assert event.recomputed_tokens == 0
    assert event.loaded_tokens == context_tokens - 1
    assert len(received) + len(resumed) == MAX_TOKENS
