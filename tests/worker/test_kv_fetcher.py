"""The KV fetcher: a resume's stored blocks read and verified by a process of its own (at the
lowest CPU priority) against a real redis-server, handed back as views of shared memory."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis

from store import (
    BlockRejected,
    KVBlock,
    RedisStore,
    RejectReason,
    StoreConfig,
    StoreUnavailable,
    block_reads,
)
from store import keys as store_keys
from tests.context_daemon.test_store_blocks import FORMAT, create, payload_for, writes_for
from tests.support.redis_server import RedisServer
from worker.kv_fetcher import FETCHER_NICE, SHARED_MEMORY_DIR, KVFetcher

TOKENS = list(range(2000, 2000 + 16 * 4 + 7))  # four full blocks and a tail of 7


@pytest.fixture
def fetcher(redis_server: RedisServer, store: RedisStore) -> Iterator[KVFetcher]:
    fetcher = KVFetcher(StoreConfig(url=redis_server.url), store)
    yield fetcher
    fetcher.close()


def _stored(store: RedisStore) -> str:
    request_id = create(store, TOKENS)
    assert all(store.put_blocks(writes_for(request_id, TOKENS)))
    return request_id


def _fetcher_pid(fetcher: KVFetcher) -> int:
    process = fetcher._process  # noqa: SLF001  (which process serves it is what is checked)
    assert process is not None and process.poll() is None, "the fetcher process runs"
    return process.pid


def _shared_files() -> set[str]:
    return {p.name for p in SHARED_MEMORY_DIR.glob("spotinfer-kv-*")}


def test_blocks_come_back_as_the_store_reads_them_from_a_low_priority_process(
    store: RedisStore, fetcher: KVFetcher
) -> None:
    request_id = _stored(store)
    reads = block_reads(request_id, FORMAT, TOKENS)
    before = _shared_files()

    fetched = fetcher.get_blocks(reads, FORMAT)

    direct = store.get_blocks(reads, FORMAT)
    assert all(isinstance(b, KVBlock) for b in fetched) and len(fetched) == 5
    for got, want, index in zip(fetched, direct, range(5), strict=True):
        assert isinstance(got, KVBlock) and isinstance(want, KVBlock)
        assert bytes(got.payload) == bytes(want.payload) == payload_for(index)
        assert (got.prefix_hash, got.num_tokens) == (want.prefix_hash, want.num_tokens)
    pid = _fetcher_pid(fetcher)
    assert pid != os.getpid()
    assert os.getpriority(os.PRIO_PROCESS, pid) == FETCHER_NICE
    assert _shared_files() == before, "the reply's file is unlinked once mapped"


def test_a_block_that_fails_its_checksum_is_refused_as_the_store_refuses_it(
    redis_server: RedisServer, store: RedisStore, fetcher: KVFetcher
) -> None:
    request_id = _stored(store)
    reads = block_reads(request_id, FORMAT, TOKENS)
    client = redis.Redis.from_url(redis_server.url)
    key = store_keys.block_key(reads[1].prefix_hash)
    value = bytearray(client.get(key) or b"")
    value[-1] ^= 0xFF  # one payload byte
    client.set(key, bytes(value))
    client.close()

    fetched = fetcher.get_blocks(reads, FORMAT)

    assert isinstance(fetched[0], KVBlock) and isinstance(fetched[2], KVBlock)
    assert isinstance(fetched[1], BlockRejected)
    assert fetched[1].reason is RejectReason.CHECKSUM
    assert bytes(fetched[2].payload) == payload_for(2)


def test_a_fetcher_that_died_costs_nothing_but_its_process(
    store: RedisStore, fetcher: KVFetcher
) -> None:
    request_id = _stored(store)
    reads = block_reads(request_id, FORMAT, TOKENS)
    fetcher.get_blocks(reads[:1], FORMAT)
    dead = _fetcher_pid(fetcher)
    os.kill(dead, 9)

    fetched = fetcher.get_blocks(reads, FORMAT)  # a new fetcher, or this process, reads it
    assert [bytes(b.payload) for b in fetched if isinstance(b, KVBlock)] == [
        payload_for(i) for i in range(5)
    ]
    # The read after the failure starts a new fetcher.
    fetcher.get_blocks(reads[:1], FORMAT)
    assert _fetcher_pid(fetcher) != dead


def test_a_store_that_is_down_is_unavailable_not_empty() -> None:
    with RedisServer() as server:
        url = server.url
        store = RedisStore.from_url(url)
        request_id = _stored(store)
        reads = block_reads(request_id, FORMAT, TOKENS)
        fetcher = KVFetcher(StoreConfig(url=url), store)
        try:
            fetcher.get_blocks(reads[:1], FORMAT)
            server.kill()
            with pytest.raises(StoreUnavailable):
                fetcher.get_blocks(reads, FORMAT)
        finally:
            fetcher.close()
            store.close()
