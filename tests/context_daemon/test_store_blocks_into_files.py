"""Blocks read from a real redis-server straight into a file (RedisStore.get_blocks_into, the
KV fetcher's read): every value taken off the socket in pieces and checked on the way, with
get_blocks' verdicts; over TLS with a worker's ACL user too. A cluster store says it cannot
and refuses, never half-reads."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import pytest
import redis

from spotinfer.local.redis_process import RedisProcess
from spotinfer.local.redis_security import Role
from store import (
    BlockRead,
    BlockRejected,
    KVBlock,
    KVFormat,
    RedisStore,
    RejectReason,
    StoreError,
    StoreUnavailable,
    block_reads,
    streamed_reads,
)
from store import keys as store_keys
from store.keys import shard_suffix
from store.streamed_reads import PayloadAt
from tests.context_daemon.conftest import TEST_STORE_CONFIG
from tests.context_daemon.test_store_blocks import FORMAT, create, payload_for, writes_for
from tests.support.redis_server import RedisCluster, RedisServer

TOKENS = list(range(3000, 3000 + 16 * 4 + 7))  # four full blocks and a tail of 7


@pytest.fixture
def single(redis_server: RedisServer) -> Iterator[RedisStore]:
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    yield RedisStore(client, TEST_STORE_CONFIG)
    client.close()


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A plain client of the same server, to tamper with what is stored."""
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def out() -> Iterator[BinaryIO]:
    descriptor, path = tempfile.mkstemp(prefix="blocks-into-")
    with os.fdopen(descriptor, "w+b", buffering=0) as file:
        yield file
    Path(path).unlink()


def _stored(store: RedisStore, kv_format: KVFormat = FORMAT) -> list[BlockRead]:
    request_id = create(store, TOKENS)
    assert all(store.put_blocks(writes_for(request_id, TOKENS, kv_format=kv_format)))
    return block_reads(request_id, kv_format, TOKENS)


def _file_bytes(out: BinaryIO) -> bytes:
    out.seek(0)
    return out.read()


def _verdicts(results: Sequence[KVBlock | PayloadAt | BlockRejected]) -> list[object]:
    return [
        (r.reason, r.detail) if isinstance(r, BlockRejected) else (r.prefix_hash, r.num_tokens)
        for r in results
    ]


def _same_as_get_blocks(
    store: RedisStore, reads: list[BlockRead], out: BinaryIO, kv_format: KVFormat = FORMAT
) -> bytes:
    """get_blocks_into's results against get_blocks' on the same keys: the same verdicts,
    each passing payload in the file at the offset it says, the payloads back to back (in
    the order they arrived) and nothing else there."""
    into = store.get_blocks_into(reads, kv_format, out)
    whole = store.get_blocks(reads, kv_format)
    assert _verdicts(into) == _verdicts(whole)
    data = _file_bytes(out)
    spans = []
    for got, want in zip(into, whole, strict=True):
        if isinstance(got, PayloadAt):
            assert isinstance(want, KVBlock)
            assert data[got.offset : got.offset + got.length] == bytes(want.payload)
            spans.append((got.offset, got.length))
    at = 0
    for offset, length in sorted(spans):
        assert offset == at, "payloads follow one another"
        at += length
    assert len(data) == at, "nothing of a refused block is left in the file"
    return data


@pytest.mark.parametrize("piece_bytes", [7, 1000, streamed_reads.READ_PIECE_BYTES])
def test_every_block_comes_into_the_file_as_get_blocks_reads_it(
    single: RedisStore, out: BinaryIO, piece_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(streamed_reads, "READ_PIECE_BYTES", piece_bytes)
    reads = _stored(single)
    data = _same_as_get_blocks(single, reads, out)
    assert data == b"".join(payload_for(i) for i in range(5))


def test_refused_blocks_leave_nothing_and_the_rest_follow_one_another(
    raw: redis.Redis, single: RedisStore, out: BinaryIO
) -> None:
    reads = _stored(single)
    corrupted = store_keys.block_key(reads[1].prefix_hash)
    value = bytearray(raw.get(corrupted) or b"")
    value[-1] ^= 0xFF
    raw.set(corrupted, bytes(value))
    raw.delete(store_keys.block_key(reads[2].prefix_hash))
    data = _same_as_get_blocks(single, reads, out)
    assert data == payload_for(0) + payload_for(3) + payload_for(4)
    results = single.get_blocks_into(reads, FORMAT, out)
    reasons = [r.reason if isinstance(r, BlockRejected) else None for r in results]
    assert reasons == [None, RejectReason.CHECKSUM, RejectReason.MISSING, None, None]


def test_blocks_all_refused_leave_an_empty_file(single: RedisStore, out: BinaryIO) -> None:
    reads = _stored(single)
    other = dataclasses.replace(FORMAT, dtype="bfloat16")
    results = single.get_blocks_into(reads, other, out)
    assert all(isinstance(r, BlockRejected) and r.reason is RejectReason.DTYPE for r in results)
    assert _file_bytes(out) == b""


def test_a_shards_tail_is_read_from_the_tails_hash(single: RedisStore, out: BinaryIO) -> None:
    sharded = dataclasses.replace(FORMAT, layout="test:tp=1/2", shard=shard_suffix(1))
    reads = _stored(single, sharded)
    assert reads[-1].shard and not reads[-1].is_full
    data = _same_as_get_blocks(single, reads, out, sharded)
    assert data == b"".join(payload_for(i) for i in range(5))


def test_an_error_reply_is_a_store_error_and_the_next_read_is_whole(
    raw: redis.Redis, single: RedisStore, out: BinaryIO
) -> None:
    reads = _stored(single)
    wrong = store_keys.block_key(reads[3].prefix_hash)
    raw.delete(wrong)
    raw.hset(wrong, "f", "v")  # GETEX on a hash: WRONGTYPE
    with pytest.raises(StoreError, match="WRONGTYPE"):
        single.get_blocks_into(reads, FORMAT, out)
    # The replies after the error were never read; the connection that held them is gone.
    out.seek(0)
    out.truncate(0)
    results = single.get_blocks_into(reads[:3], FORMAT, out)
    assert _file_bytes(out) == b"".join(payload_for(i) for i in range(3))
    assert all(isinstance(r, PayloadAt) for r in results)


def test_a_store_that_is_down_is_unavailable(out: BinaryIO) -> None:
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url, socket_timeout=2)
        store = RedisStore(client, TEST_STORE_CONFIG)
        reads = _stored(store)
        server.kill()
        with pytest.raises(StoreUnavailable):
            store.get_blocks_into(reads, FORMAT, out)
        client.close()


def test_over_tls_as_a_worker(secure_redis: RedisProcess, out: BinaryIO) -> None:
    assert secure_redis.security is not None
    config = secure_redis.security.store_config(secure_redis.url, Role.WORKER)
    store = RedisStore.from_config(config)
    try:
        assert secure_redis.url.startswith("rediss://")
        reads = _stored(store)
        data = _same_as_get_blocks(store, reads, out)
        assert data == b"".join(payload_for(i) for i in range(5))
    finally:
        store.close()


@pytest.fixture
def clustered(redis_cluster: RedisCluster) -> Iterator[tuple[redis.RedisCluster, RedisStore]]:
    """A client of the 3-master cluster and a store on it."""
    client = redis.RedisCluster.from_url(redis_cluster.url, socket_timeout=5)
    yield client, RedisStore(client, TEST_STORE_CONFIG)
    client.close()


def test_a_clusters_nodes_are_each_read_in_turn(
    clustered: tuple[redis.RedisCluster, RedisStore], out: BinaryIO
) -> None:
    client, store = clustered
    reads = _stored(store)
    nodes = {client.get_node_from_key(read.key).name for read in reads}
    assert len(nodes) > 1, "the blocks spread over several masters"
    data = _same_as_get_blocks(store, reads, out)
    assert sorted(_chunks(data)) == sorted(payload_for(i) for i in range(5))


def test_a_stale_slot_map_is_read_again_and_the_blocks_read_whole(
    clustered: tuple[redis.RedisCluster, RedisStore],
    out: BinaryIO,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A node that no longer holds a key answers MOVED: the read is made again as get_blocks
    makes it (which follows the move), nothing of the first attempt left in the file."""
    client, store = clustered
    reads = _stored(store)
    owner = client.get_node_from_key(reads[2].key)
    elsewhere = next(n for n in client.get_primaries() if n.name != owner.name)
    right = client.get_node_from_key
    monkeypatch.setattr(
        client,
        "get_node_from_key",
        lambda key, replica=False: elsewhere if key == reads[2].key else right(key, replica),
    )
    with caplog.at_level("INFO", logger="store.redis_store"):
        data = _same_as_get_blocks(store, reads, out)
    assert any("MOVED" in r.getMessage() for r in caplog.records), "the first read was moved"
    assert data == b"".join(payload_for(i) for i in range(5))


def _chunks(data: bytes) -> list[bytes]:
    size = len(payload_for(0))
    return [data[i : i + size] for i in range(0, len(data), size)]
