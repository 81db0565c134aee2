"""KV blocks in a real Redis (standalone and cluster): dedupe, verification, expiry, leaks."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from redis.crc import key_slot

from store import (
    BlockRead,
    BlockRejected,
    BlockWrite,
    KVBlock,
    KVFormat,
    RedisStore,
    RejectReason,
    RequestRecord,
    StoreConfig,
    block_reads,
)
from store import keys as store_keys

FORMAT = KVFormat(
    model_fingerprint="tiny-llama:fp32:abc",
    dtype="float32",
    layout="cpu:blocks,kv_heads,block,2*head_dim",
    layer_count=2,
    block_tokens=16,
)
BLOCK_PAYLOAD_BYTES = 2 * 2 * 16 * 64 * 4


def payload_for(index: int, seed: int = 0) -> bytes:
    """Distinct, recognisable bytes per block (what a real layer copy would be)."""
    pattern = bytes((index * 31 + seed * 7 + i) % 251 for i in range(251))
    return (pattern * (BLOCK_PAYLOAD_BYTES // 251 + 1))[:BLOCK_PAYLOAD_BYTES]


def create(store: RedisStore, tokens: list[int]) -> str:
    request_id = f"blk-{uuid.uuid4().hex[:12]}"
    store.create_request(
        RequestRecord(
            request_id=request_id,
            model_fingerprint=FORMAT.model_fingerprint,
            prompt_token_ids=tuple(tokens),
            sampling_params={},
            kv_block_tokens=FORMAT.block_tokens,
        )
    )
    return request_id


def writes_for(
    request_id: str, tokens: list[int], seed: int = 0, kv_format: KVFormat = FORMAT
) -> list[BlockWrite]:
    return [
        BlockWrite(
            request_id,
            read.block_index,
            KVBlock(
                kv_format, read.prefix_hash, read.num_tokens, payload_for(read.block_index, seed)
            ),
            kv_format.shard,
        )
        for read in block_reads(request_id, kv_format, tokens)
    ]


def test_blocks_and_tail_round_trip_and_are_listed_in_the_record(store: RedisStore) -> None:
    tokens = list(range(1000, 1000 + 16 * 3 + 5))
    request_id = create(store, tokens)
    assert store.put_blocks(writes_for(request_id, tokens)) == [True] * 4
    reads = block_reads(request_id, FORMAT, tokens)
    loaded = store.get_blocks(reads, FORMAT)
    assert [block.payload for block in loaded if isinstance(block, KVBlock)] == [
        payload_for(i) for i in range(4)
    ]
    assert isinstance(loaded[3], KVBlock) and loaded[3].num_tokens == 5
    record = store.get_request(request_id)
    assert record.persisted_block_hashes == tuple(read.prefix_hash for read in reads[:3])


def test_shared_prefix_is_stored_once(store: RedisStore) -> None:
    prefix = list(range(500, 532))  # two full blocks
    first_tokens = prefix + [1] * 16
    second_tokens = prefix + [2] * 16
    first = create(store, first_tokens)
    second = create(store, second_tokens)
    store.put_blocks(writes_for(first, first_tokens))
    shared_reads = block_reads(second, FORMAT, second_tokens)
    assert store.blocks_present([read.prefix_hash for read in shared_reads]) == [
        True,
        True,
        False,
    ]
    # the second request loads the first request's prefix blocks, verified against its tokens
    loaded = store.get_blocks(shared_reads[:2], FORMAT)
    assert [block.payload for block in loaded if isinstance(block, KVBlock)] == [
        payload_for(0),
        payload_for(1),
    ]


def test_a_flipped_byte_in_redis_is_rejected_as_checksum(
    store: RedisStore, redis_client: redis.Redis | redis.RedisCluster
) -> None:
    tokens = list(range(16 * 2))
    request_id = create(store, tokens)
    store.put_blocks(writes_for(request_id, tokens, seed=3))
    reads = block_reads(request_id, FORMAT, tokens)
    key = reads[1].key
    stored = redis_client.get(key)
    assert isinstance(stored, bytes)
    offset = len(stored) - 1000  # somewhere in the payload
    redis_client.setrange(key, offset, bytes([stored[offset] ^ 0x40]))
    first, second = store.get_blocks(reads, FORMAT)
    assert isinstance(first, KVBlock)
    assert isinstance(second, BlockRejected)
    assert second.reason is RejectReason.CHECKSUM


def test_block_of_other_tokens_under_a_key_is_rejected(
    store: RedisStore, redis_client: redis.Redis | redis.RedisCluster
) -> None:
    tokens = list(range(16 * 2))
    request_id = create(store, tokens)
    store.put_blocks(writes_for(request_id, tokens))
    reads = block_reads(request_id, FORMAT, tokens)
    misplaced = redis_client.get(reads[0].key)
    assert isinstance(misplaced, bytes)
    redis_client.set(reads[1].key, misplaced)  # a value stored under the wrong key
    (moved,) = store.get_blocks([reads[1]], FORMAT)
    assert isinstance(moved, BlockRejected) and moved.reason is RejectReason.PREFIX_HASH


@pytest.mark.parametrize(
    ("reader_format", "reason"),
    [
        (KVFormat("other-model", FORMAT.dtype, FORMAT.layout, 2, 16), RejectReason.FINGERPRINT),
        (KVFormat(FORMAT.model_fingerprint, "bfloat16", FORMAT.layout, 2, 16), RejectReason.DTYPE),
        (KVFormat(FORMAT.model_fingerprint, "float32", "gpu:nhd", 2, 16), RejectReason.LAYOUT),
        (
            KVFormat(FORMAT.model_fingerprint, "float32", FORMAT.layout, 4, 16),
            RejectReason.GEOMETRY,
        ),
    ],
)
def test_format_mismatch_is_rejected(
    store: RedisStore, reader_format: KVFormat, reason: RejectReason
) -> None:
    tokens = list(range(16))
    request_id = create(store, tokens)
    store.put_blocks(writes_for(request_id, tokens))
    # read the very key that was written, expecting another format
    (read,) = block_reads(request_id, FORMAT, tokens)
    (loaded,) = store.get_blocks([read], reader_format)
    assert isinstance(loaded, BlockRejected) and loaded.reason is reason


def test_missing_blocks_are_rejected_not_invented(store: RedisStore) -> None:
    tokens = [7] * 20
    request_id = create(store, tokens)
    loaded = store.get_blocks(block_reads(request_id, FORMAT, tokens), FORMAT)
    assert [getattr(item, "reason", None) for item in loaded] == [RejectReason.MISSING] * 2


def test_reading_a_block_restarts_its_ttl(
    store: RedisStore, redis_client: redis.Redis | redis.RedisCluster
) -> None:
    tokens = list(range(3000, 3016))
    request_id = create(store, tokens)
    store.put_blocks(writes_for(request_id, tokens))
    (read,) = block_reads(request_id, FORMAT, tokens)
    assert 0 < store.block_ttl_seconds(read.prefix_hash) <= store.config.block_ttl_seconds
    redis_client.expire(read.key, 3)
    store.get_blocks([read], FORMAT)
    assert store.block_ttl_seconds(read.prefix_hash) > store.config.block_ttl_seconds - 5
    redis_client.expire(read.key, 3)
    store.put_blocks(writes_for(request_id, tokens))  # writing it again also refreshes
    assert store.block_ttl_seconds(read.prefix_hash) > store.config.block_ttl_seconds - 5


def test_delete_leaves_no_request_keys_and_late_writes_leave_none(store: RedisStore) -> None:
    tokens = list(range(16 + 3))
    request_id = create(store, tokens)
    store.put_blocks(writes_for(request_id, tokens))
    store.commit(request_id, 0, [1, 2])
    assert len(store.keys_for_request(request_id)) == 4
    store.delete_request(request_id)
    assert store.keys_for_request(request_id) == []
    assert store.put_blocks(writes_for(request_id, tokens)) == [False, False]
    assert store.keys_for_request(request_id) == []


def test_keys_of_a_request_share_one_slot_and_blocks_spread() -> None:
    slots = {key_slot(key.encode()) for key in store_keys.request_keys("r-1")}
    assert len(slots) == 1
    block_slots = {
        key_slot(store_keys.block_key(read.prefix_hash).encode())
        for read in block_reads("r-1", FORMAT, list(range(16 * 20)))
    }
    assert len(block_slots) > 10
    with pytest.raises(ValueError):
        store_keys.request_meta_key("a}b")
    with pytest.raises(ValueError):
        store_keys.request_meta_key("")


def test_block_read_names_the_block() -> None:
    read = BlockRead("r-1", 2, bytes(16), 16, is_full=True)
    assert read.name.startswith("r-1#2(block ")


def test_a_block_and_its_record_expire_on_ttls_of_their_own(
    redis_client: redis.Redis | redis.RedisCluster,
) -> None:
    """Records and blocks live in separate key spaces (``req:{id}:*``, ``blk:{hash}``), each
    with its own TTL: a commit restarts the record's and leaves the block's alone, and the
    block expiring takes nothing of the record that lists it (its tail still loads)."""
    store = RedisStore(redis_client, StoreConfig(request_ttl_seconds=600, block_ttl_seconds=1))
    tokens = list(range(4000, 4016 + 3))
    request_id = create(store, tokens)
    store.put_blocks(writes_for(request_id, tokens))
    full, tail = block_reads(request_id, FORMAT, tokens)
    assert 0 < store.block_ttl_seconds(full.prefix_hash) <= 1
    store.commit(request_id, 0, [1, 2])
    record_ttls = store.request_ttl_seconds(request_id)
    assert len(record_ttls) == 4 and all(590 < ttl <= 600 for ttl in record_ttls.values())
    assert store.block_ttl_seconds(full.prefix_hash) <= 1, "the commit left the block's TTL"
    time.sleep(1.5)
    assert store.block_ttl_seconds(full.prefix_hash) == -2, "the block expired"
    assert store.request_ttl_seconds(request_id).keys() == record_ttls.keys()
    assert store.get_request(request_id).persisted_block_hashes == (full.prefix_hash,)
    missing, loaded_tail = store.get_blocks([full, tail], FORMAT)
    assert isinstance(missing, BlockRejected) and missing.reason is RejectReason.MISSING
    assert isinstance(loaded_tail, KVBlock) and loaded_tail.num_tokens == 3
