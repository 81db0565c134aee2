"""The connector's writer against a real Redis: a flush written before the request's record
exists (the token committer creates it off the stream's path, and can lag) lands once the
record is there."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from store import (
    KVFormat,
    RedisStore,
    RequestRecord,
    RequestStatus,
    TokenCommit,
    block_hashes,
    tail_hash,
)
from store.block_codec import header_bytes
from store.block_writer import KVBlockWriter, PendingBlock
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until
from worker.flush_state import read_flush_state

FORMAT = KVFormat(
    model_fingerprint="tiny-llama:fp32:writer",
    dtype="float32",
    layout="cpu:blocks,kv_heads,block,2*head_dim",
    layer_count=2,
    block_tokens=16,
)
PAYLOAD_BYTES = 2 * 2 * 16 * 64 * 4
PROMPT = tuple(range(100, 137))  # 37 tokens
OUTPUTS = (7, 8, 9)  # context 40: KV for 39 tokens = 2 full blocks and a 7-token tail


@pytest.fixture(scope="module")
def store(redis_server: RedisServer) -> Iterator[RedisStore]:
    store = RedisStore.from_url(redis_server.url)
    yield store
    store.close()


@pytest.fixture
def writer(store: RedisStore) -> Iterator[KVBlockWriter]:
    writer = KVBlockWriter(store, FORMAT, max_queued_blocks=64)
    yield writer
    writer.close(5.0)


def _block(request_id: str, index: int, prefix_hash: bytes, num_tokens: int = 0) -> PendingBlock:
    data = torch.full((header_bytes(FORMAT) + PAYLOAD_BYTES,), index + 1, dtype=torch.uint8)
    return PendingBlock(request_id, index, prefix_hash, data, num_tokens)


def _record(request_id: str) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        model_fingerprint=FORMAT.model_fingerprint,
        prompt_token_ids=PROMPT,
        sampling_params={"max_tokens": 64},
        kv_block_tokens=FORMAT.block_tokens,
        status=RequestStatus.RUNNING,
        owner_worker_id="worker-a",
    )


def test_a_flush_written_before_its_record_exists_lands_once_it_does(
    store: RedisStore, writer: KVBlockWriter
) -> None:
    request_id = "writer-late-record"
    context = list(PROMPT + OUTPUTS)
    full = block_hashes(FORMAT.model_fingerprint, context[:32], FORMAT.block_tokens)
    tail = tail_hash(FORMAT.model_fingerprint, context[:39], FORMAT.block_tokens)
    assert tail is not None
    # Saved while it ran (its links refused: no record yet), then its pause's flush.
    writer.submit(_block(request_id, 0, full[0]))
    writer.submit(_block(request_id, 1, full[1]))
    writer.submit_tokens(TokenCommit(request_id, 0, OUTPUTS))
    writer.submit(_block(request_id, 2, tail, num_tokens=7), required=True)
    assert writer.wait_settled(3, 10.0)
    # Its refused writes were tried again at least once before the record came.
    assert writer.wait_rounds(writer.rounds + 1, 10.0)

    store.create_request(_record(request_id))  # the token committer, late
    store.update_status(request_id, RequestStatus.PAUSED)

    def complete() -> bool:
        state = read_flush_state(
            store, request_id, FORMAT.model_fingerprint, FORMAT.block_tokens, 0, True
        )
        return state.complete

    wait_until(complete, "the flush complete in the store", 10)
    record = store.get_request(request_id)
    assert record.persisted_block_hashes == tuple(full)
    assert store.committed_tokens(request_id) == list(OUTPUTS)


def test_a_pause_without_kv_is_marked_once_the_record_exists(
    store: RedisStore, writer: KVBlockWriter
) -> None:
    request_id = "writer-late-mark"
    rounds = writer.rounds
    writer.submit_no_kv(request_id)
    assert writer.wait_rounds(rounds + 1, 10.0), "the mark was tried (and refused)"
    store.create_request(_record(request_id))
    store.update_status(request_id, RequestStatus.PAUSED)
    wait_until(lambda: store.get_request(request_id).paused_without_kv, "the record marked", 10)


def test_writes_of_an_ended_request_stay_refused(store: RedisStore, writer: KVBlockWriter) -> None:
    request_id = "writer-ended"
    store.create_request(_record(request_id))
    store.finish_request(request_id, RequestStatus.CANCELLED)  # no retention: deleted
    rounds = writer.rounds
    writer.submit_tokens(TokenCommit(request_id, 0, OUTPUTS))
    writer.submit_no_kv(request_id)
    # Their first round and a retry are over: both were refused.
    assert writer.wait_rounds(rounds + 2, 10.0)
    assert store.keys_for_request(request_id) == []
