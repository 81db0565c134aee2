"""Abrupt loss: worker A is SIGKILLed mid-generation; worker B resumes from Redis.

Real processes only: a redis-server, two `python -m worker` processes with the spot KV
connector. The output a client assembles (what A streamed, then what B streams) must equal an
uninterrupted greedy run token for token, and B may recompute only the tokens after the last
block A persisted.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
import redis

from protos.spotinfer.v1 import common_pb2, worker_pb2
from spotinfer.local.worker_process import WorkerProcess
from store import (
    RedisStore,
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
    generate,
    greedy_request,
    resume_stream,
)
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until
from worker.model_fingerprint import model_fingerprint

MAX_TOKENS = 900  # with a 50-token prompt: 7 full blocks by the end
MIN_PERSISTED_BLOCKS = 2


@pytest.fixture(scope="module")
def fingerprint(tiny_model: Path) -> str:
    return model_fingerprint(str(tiny_model), "float32")


def persisted_blocks(store: RedisStore, fingerprint: str, token_ids: Sequence[int]) -> int:
    """How many leading full blocks of ``token_ids`` Redis holds."""
    hashes = block_hashes(fingerprint, list(token_ids), BLOCK_TOKENS)
    count = 0
    for present in store.blocks_present(hashes) if hashes else []:
        if not present:
            break
        count += 1
    return count


def generate_then_kill(
    tiny_model: Path,
    redis_server: RedisServer,
    store: RedisStore,
    fingerprint: str,
    request_id: str,
    prompt: list[int],
    log_dir: Path,
) -> list[int]:
    """Worker A generates until at least two blocks are in Redis, then is SIGKILLed.
    Returns the tokens the client received from A."""
    with WorkerProcess(
        tiny_model, *worker_flags(redis_server.url), "--worker-id", "worker-a", log_dir=log_dir
    ) as worker_a:
        reader = StreamReader(
            worker_a.stub.Generate(
                greedy_request(request_id, prompt, MAX_TOKENS), timeout=STREAM_TIMEOUT_SECONDS
            )
        )
        wait_until(
            lambda: (
                reader.done
                or persisted_blocks(store, fingerprint, prompt + reader.tokens())
                >= MIN_PERSISTED_BLOCKS
            ),
            f"{MIN_PERSISTED_BLOCKS} KV blocks of {request_id} in Redis",
        )
        worker_a.kill()
        reader.join()
    finished = [r for r in reader.responses if r.finish_reason != 0]
    assert not finished, "worker A finished before it was killed; the test proves nothing"
    assert reader.error is not None, "the stream from the killed worker must break"
    return reader.tokens()


def test_abrupt_loss_resumes_on_another_worker_with_identical_output(
    tiny_model: Path,
    redis_server: RedisServer,
    store: RedisStore,
    standby: WorkerProcess,
    fingerprint: str,
    tmp_path: Path,
) -> None:
    request_id = "abrupt-loss-1"
    prompt = list(range(40, 90))
    received = generate_then_kill(
        tiny_model, redis_server, store, fingerprint, request_id, prompt, tmp_path
    )
    record = store.get_request(request_id)
    assert record.owner_worker_id == "worker-a"
    assert record.status == RequestStatus.RUNNING
    committed = store.committed_tokens(request_id)
    assert committed == received[: len(committed)], "committed tokens are what A streamed"
    context_tokens = len(prompt) + len(committed)
    persisted = persisted_blocks(store, fingerprint, prompt + committed)
    assert persisted >= MIN_PERSISTED_BLOCKS

    event, resumed = resume_stream(standby, request_id, from_index=len(received))

    # B persists from where A stopped (checked before the reference run stores the same
    # content-addressed blocks), and once the request ends its keys are gone.
    full_blocks = (len(prompt) + MAX_TOKENS - 1) // BLOCK_TOKENS
    wait_until(
        lambda: persisted_blocks(store, fingerprint, prompt + received + resumed) == full_blocks,
        "every full block of the resumed request in Redis",
    )
    # No coordinator here: the test says what one would once its client got the end.
    store.release_request(request_id)
    wait_until(lambda: not store.keys_for_request(request_id), "the finished request's keys gone")
    reference = generate(standby, greedy_request("abrupt-loss-reference", prompt, MAX_TOKENS))
    assert received + resumed == reference
    assert event.kind == common_pb2.EVENT_KIND_RECOVERED
    assert event.from_worker == "worker-a" and event.to_worker == "worker-b"
    assert event.loaded_tokens == min(persisted * BLOCK_TOKENS, context_tokens - 1) > 0
    assert event.recomputed_tokens == context_tokens - event.loaded_tokens - 1
    assert event.recomputed_tokens <= context_tokens - persisted * BLOCK_TOKENS


def test_corrupted_block_is_rejected_and_recomputed(
    tiny_model: Path,
    redis_server: RedisServer,
    store: RedisStore,
    standby: WorkerProcess,
    fingerprint: str,
    tmp_path: Path,
) -> None:
    request_id = "corrupted-block-1"
    prompt = list(range(300, 340))
    received = generate_then_kill(
        tiny_model, redis_server, store, fingerprint, request_id, prompt, tmp_path
    )
    committed = store.committed_tokens(request_id)
    context_tokens = len(prompt) + len(committed)
    hashes = block_hashes(fingerprint, prompt + committed, BLOCK_TOKENS)
    client = redis.Redis.from_url(redis_server.url)
    try:
        key = block_key(hashes[1])
        stored = client.get(key)
        assert isinstance(stored, bytes), "block 1 must be in Redis before it can be corrupted"
        value = bytearray(stored)
        value[-1] ^= 0x01  # one bit of the last KV element
        client.set(key, bytes(value))
    finally:
        client.close()

    # From index 0: the client lost everything, so B also replays the committed tokens.
    event, resumed = resume_stream(standby, request_id, from_index=0)

    reference = generate(standby, greedy_request("corrupted-block-reference", prompt, MAX_TOKENS))
    assert resumed == reference
    assert received == reference[: len(received)]
    # Block 0 loads; block 1 is rejected, so it and everything after it is recomputed.
    assert event.loaded_tokens == BLOCK_TOKENS
    assert event.recomputed_tokens == context_tokens - BLOCK_TOKENS - 1
    assert "rejected (checksum)" in standby.output


def test_resume_of_an_unknown_request_is_not_found(standby: WorkerProcess) -> None:
    with pytest.raises(grpc.RpcError) as error:
        list(standby.stub.Resume(worker_pb2.ResumeRequest(request_id="never-seen"), timeout=60))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("case", ["cancelled", "other-model"])
def test_resume_refused_for_a_cancelled_or_foreign_request(
    case: str, redis_server: RedisServer, standby: WorkerProcess, fingerprint: str
) -> None:
    retaining = RedisStore.from_url(redis_server.url, config=StoreConfig(retention_seconds=600))
    request_id = f"refused-{case}"
    try:
        retaining.create_request(
            RequestRecord(
                request_id=request_id,
                model_fingerprint=fingerprint if case == "cancelled" else "another-model",
                prompt_token_ids=(40, 41, 42),
                sampling_params={"max_tokens": 8, "temperature": 0.0},
                kv_block_tokens=BLOCK_TOKENS,
                status=RequestStatus.RUNNING,
                owner_worker_id="worker-gone",
            )
        )
        if case == "cancelled":
            retaining.finish_request(request_id, RequestStatus.CANCELLED)
        with pytest.raises(grpc.RpcError) as error:
            list(standby.stub.Resume(worker_pb2.ResumeRequest(request_id=request_id), timeout=60))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        retaining.delete_request(request_id)
        retaining.close()


def test_resume_of_a_finished_request_replays_what_the_client_lacks(
    redis_server: RedisServer, standby: WorkerProcess, fingerprint: str
) -> None:
    """It finished before its caller got the end (the store keeps it until someone does):
    the rest of its output and its end, from the store, with no engine step."""
    store = RedisStore.from_url(redis_server.url, config=StoreConfig())
    request_id = "finished-unseen"
    try:
        store.create_request(
            RequestRecord(
                request_id=request_id,
                model_fingerprint=fingerprint,
                prompt_token_ids=(40, 41, 42),
                sampling_params={"max_tokens": 8, "temperature": 0.0},
                kv_block_tokens=BLOCK_TOKENS,
                status=RequestStatus.RUNNING,
                owner_worker_id="worker-gone",
            )
        )
        store.commit(request_id, 0, [5, 6, 7, 8, 9])
        store.finish_request(request_id, RequestStatus.FINISHED, "STOP")
        responses = list(
            standby.stub.Resume(
                worker_pb2.ResumeRequest(request_id=request_id, from_index=2), timeout=60
            )
        )
        assert [(r.index, list(r.token_ids)) for r in responses] == [(2, [7, 8, 9])]
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    finally:
        store.delete_request(request_id)
        store.close()
