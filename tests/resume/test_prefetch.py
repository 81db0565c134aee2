"""The target's side of a staged migration: Worker.Prefetch while the source still decodes
(staging the blocks and warming them into vLLM's cache), then the pause, then a Resume that
finds the staged blocks in the cache instead of reading Redis.

Real processes: a redis-server, worker A (the source) and the package's standby B.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from protos.spotinfer.v1 import common_pb2, worker_pb2
from spotinfer.local.worker_process import WorkerProcess
from store import (
    RedisStore,
    RequestNotFound,
    RequestRecord,
    RequestStatus,
    StoreConfig,
    block_hashes,
)
from store.keys import block_key
from tests.resume.conftest import BLOCK_TOKENS, worker_flags
from tests.resume.streams import (
    STREAM_TIMEOUT_SECONDS,
    StreamReader,
    assemble,
    generate,
    greedy_request,
    recovery_event,
)
from tests.resume.test_abrupt_loss import persisted_blocks
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until
from worker.model_fingerprint import model_fingerprint

MAX_TOKENS = 700
PROMPT = [(7 * n) % 500 + 3 for n in range(280)]  # a full stored chunk before the first output
# Requests beside the migrated one, so that the tiny model's steps leave time for the stages.
FILLERS = 12


def loaded_blocks(worker: WorkerProcess, source: str) -> float:
    """The worker's spotinfer_worker_kv_loaded_blocks_total{source=...}."""
    with urllib.request.urlopen(worker.metrics_url, timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "spotinfer_worker_kv_loaded_blocks_total"
                and sample.labels.get("source") == source
            ):
                return sample.value
    return 0.0


def has_tokens(store: RedisStore, request_id: str) -> bool:
    try:
        return bool(store.committed_tokens(request_id))
    except RequestNotFound:
        return False


def committed_chunks(store: RedisStore, fingerprint: str, request_id: str) -> int:
    """The request's chunks in Redis that its committed context covers: a chunk counts once
    the token after it is committed too (only then is the KV of its last token computed),
    which is what a Prefetch stages from. The committed tokens trail the stream."""
    if not has_tokens(store, request_id):
        return 0
    context = PROMPT + store.committed_tokens(request_id)
    whole = (len(context) - 1) // BLOCK_TOKENS
    return min(whole, persisted_blocks(store, fingerprint, context))


def test_prefetched_blocks_are_loaded_from_staging_after_the_pause(
    tiny_model: Path,
    redis_server: RedisServer,
    store: RedisStore,
    standby: WorkerProcess,
    tmp_path: Path,
) -> None:
    fingerprint = model_fingerprint(str(tiny_model), "float32")
    request_id = "staged-migration-1"
    with WorkerProcess(
        tiny_model, *worker_flags(redis_server.url), "--worker-id", "worker-a", log_dir=tmp_path
    ) as source:
        fillers = [
            StreamReader(
                source.stub.Generate(
                    greedy_request(f"filler-{n}", [7 + n] * 200, MAX_TOKENS),
                    timeout=STREAM_TIMEOUT_SECONDS,
                )
            )
            for n in range(FILLERS)
        ]
        reader = StreamReader(
            source.stub.Generate(
                greedy_request(request_id, PROMPT, MAX_TOKENS), timeout=STREAM_TIMEOUT_SECONDS
            )
        )
        wait_until(
            lambda: reader.done or committed_chunks(store, fingerprint, request_id) >= 2,
            "two KV chunks of the request in Redis, and the tokens that complete them",
        )
        assert not reader.done, f"A ended before the first stage: {reader.error}"
        # Stage 1 while A decodes, then a second stage that stages only what is new.
        first = standby.stub.Prefetch(worker_pb2.PrefetchRequest(request_id=request_id))
        assert not first.finished
        assert first.new_blocks == first.staged_blocks >= 2
        assert first.staged_bytes > 0
        second = standby.stub.Prefetch(worker_pb2.PrefetchRequest(request_id=request_id))
        assert second.staged_blocks == first.staged_blocks + second.new_blocks
        assert not reader.done, "A finished before the pause; the test proves nothing"

        reports = list(
            source.stub.Preempt(
                worker_pb2.PreemptRequest(deadline_unix=time.time() + 30), timeout=60
            )
        )
        reader.join()
        for filler in fillers:
            filler.join()
    assert {r.request_id for r in reports} >= {request_id}
    assert all(r.complete for r in reports)
    received = reader.tokens()
    assert reader.responses[-1].event.kind == common_pb2.EVENT_KIND_NOTICE

    responses = list(
        standby.stub.Resume(
            worker_pb2.ResumeRequest(request_id=request_id, from_index=len(received)),
            timeout=STREAM_TIMEOUT_SECONDS,
        )
    )
    event = recovery_event(responses, len(received))
    resumed = assemble(responses, start_index=len(received))
    assert event.kind == common_pb2.EVENT_KIND_MIGRATED
    assert event.recomputed_tokens == 0
    assert f"{second.staged_blocks} blocks prefetched before the pause" in event.detail
    wait_until(
        lambda: loaded_blocks(standby, "staging") >= second.staged_blocks,
        "the staged blocks counted as loaded from staging",
    )
    # The stages warmed them into vLLM's prefix cache: the resume found them there and read
    # none of them again.
    wait_until(
        lambda: loaded_blocks(standby, "prefix_cache") >= second.staged_blocks,
        "the resume found the staged blocks in vLLM's cache",
    )
    # The Resume consumed the staged copies: nothing is left to drop.
    dropped = standby.stub.DropPrefetch(worker_pb2.DropPrefetchRequest(request_id=request_id))
    assert dropped.dropped_blocks == 0
    reference = generate(standby, greedy_request("staged-migration-ref", PROMPT, MAX_TOKENS))
    assert received + resumed == reference


def test_prefetch_handshake_edges(
    tiny_model: Path, redis_server: RedisServer, standby: WorkerProcess
) -> None:
    stub = standby.stub
    with pytest.raises(grpc.RpcError) as error:
        stub.Prefetch(worker_pb2.PrefetchRequest(request_id="never-seen"))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as error:
        stub.Prefetch(worker_pb2.PrefetchRequest(request_id="bad id\n"))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    unknown = stub.DropPrefetch(worker_pb2.DropPrefetchRequest(request_id="never-seen"))
    assert unknown.dropped_blocks == 0

    # A paused request as the store holds it, with two full blocks persisted (staging does not
    # look inside them: the Resume verifies). Stage, stage again (nothing new), abort the
    # handshake; once the request has finished there is nothing to move.
    fingerprint = model_fingerprint(str(tiny_model), "float32")
    retaining = RedisStore.from_url(redis_server.url, config=StoreConfig(retention_seconds=600))
    request_id = "prefetch-edges-1"
    prompt = [(3 * n) % 500 + 1 for n in range(2 * BLOCK_TOKENS + 10)]
    client = redis.Redis.from_url(redis_server.url)
    try:
        retaining.create_request(
            RequestRecord(
                request_id=request_id,
                model_fingerprint=fingerprint,
                prompt_token_ids=tuple(prompt),
                sampling_params={"max_tokens": 50, "temperature": 0.0},
                kv_block_tokens=BLOCK_TOKENS,
                status=RequestStatus.RUNNING,
                owner_worker_id="worker-gone",
            )
        )
        retaining.commit(request_id, 0, [5, 6])
        for prefix_hash in block_hashes(fingerprint, prompt, BLOCK_TOKENS):
            client.set(block_key(prefix_hash), b"\x01" * 4096)
        first = stub.Prefetch(worker_pb2.PrefetchRequest(request_id=request_id))
        assert (first.staged_blocks, first.new_blocks, first.staged_bytes) == (2, 2, 8192)
        assert first.context_tokens == len(prompt) + 2 and not first.finished
        again = stub.Prefetch(worker_pb2.PrefetchRequest(request_id=request_id))
        assert (again.staged_blocks, again.new_blocks) == (2, 0)
        dropped = stub.DropPrefetch(worker_pb2.DropPrefetchRequest(request_id=request_id))
        assert dropped.dropped_blocks == 2
        assert stub.DropPrefetch(worker_pb2.DropPrefetchRequest(request_id=request_id)) == (
            worker_pb2.DropPrefetchResponse(dropped_blocks=0)
        )
        retaining.finish_request(request_id)
        ended = stub.Prefetch(worker_pb2.PrefetchRequest(request_id=request_id))
        assert ended.finished and ended.staged_blocks == 0
    finally:
        retaining.delete_request(request_id)
        retaining.close()
        client.close()
