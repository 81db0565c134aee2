"""Redis goes away mid-generation and comes back empty: the worker keeps serving (degraded,
visible in Stats), its outputs are unchanged, and persistence resumes by itself."""

from __future__ import annotations

from pathlib import Path

from protos.spotinfer.v1 import common_pb2, worker_pb2
from spotinfer.local.worker_process import WorkerProcess
from store import RedisStore, RequestNotFound
from tests.resume.conftest import BLOCK_TOKENS, worker_flags
from tests.resume.streams import (
    STREAM_TIMEOUT_SECONDS,
    StreamReader,
    generate,
    greedy_request,
)
from tests.resume.test_abrupt_loss import persisted_blocks
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until
from worker.model_fingerprint import model_fingerprint

MAX_TOKENS = 900


def committed_length(store: RedisStore, request_id: str) -> int:
    try:
        return len(store.committed_tokens(request_id))
    except RequestNotFound:
        return 0


def degraded(worker: WorkerProcess) -> bool:
    return bool(worker.stub.Stats(worker_pb2.StatsRequest(), timeout=10).degraded)


def test_worker_survives_a_redis_outage_and_persistence_resumes(
    tiny_model: Path, own_redis_server: RedisServer, tmp_path: Path
) -> None:
    fingerprint = model_fingerprint(str(tiny_model), "float32")
    prompts = {"outage-1": list(range(100, 140)), "outage-2": list(range(150, 190))}
    store = RedisStore.from_url(own_redis_server.url)
    with WorkerProcess(
        tiny_model, *worker_flags(own_redis_server.url), "--worker-id", "worker-c", log_dir=tmp_path
    ) as worker:
        readers = {
            request_id: StreamReader(
                worker.stub.Generate(
                    greedy_request(request_id, prompt, MAX_TOKENS), timeout=STREAM_TIMEOUT_SECONDS
                )
            )
            for request_id, prompt in prompts.items()
        }
        wait_until(
            lambda: all(committed_length(store, request_id) > 0 for request_id in prompts),
            "the first tokens committed to Redis",
        )
        assert not degraded(worker)

        own_redis_server.kill()
        assert not any(reader.done for reader in readers.values()), "killed too late"
        wait_until(lambda: degraded(worker), "Stats.degraded while Redis is down")
        own_redis_server.restart()

        for request_id, reader in readers.items():
            reader.join()
            assert reader.error is None
            assert reader.responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            reference = generate(
                worker, greedy_request(f"{request_id}-reference", prompts[request_id], MAX_TOKENS)
            )
            assert reader.tokens() == reference
        wait_until(lambda: not degraded(worker), "Stats.degraded cleared after Redis returned")

        # A new request persists again: its tokens and its KV blocks reach the new Redis.
        prompt = list(range(200, 240))
        reader = StreamReader(
            worker.stub.Generate(
                greedy_request("after-outage", prompt, MAX_TOKENS), timeout=STREAM_TIMEOUT_SECONDS
            )
        )
        wait_until(lambda: committed_length(store, "after-outage") > 0, "tokens committed again")
        reader.join()
        tokens = reader.tokens()
        full_blocks = (len(prompt) + len(tokens) - 1) // BLOCK_TOKENS
        wait_until(
            lambda: persisted_blocks(store, fingerprint, prompt + tokens) == full_blocks,
            "the new request's KV blocks in Redis",
        )
    store.close()
    assert "Redis unavailable" in worker.output
