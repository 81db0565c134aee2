"""A tensor-parallel worker's ranks store their shards of one block under keys of their own:
none overwrites another, each reads back its own bytes, a reader of another degree refuses
the first rank's shard by its layout, and shard_views says which shards a flush still owes
(standalone server and cluster: the shards of a block share its slot)."""

from __future__ import annotations

import dataclasses

import redis

from store import BlockRejected, KVBlock, RedisStore, RejectReason, block_reads
from store.keys import block_key, request_keys, shard_suffix, shard_suffixes
from tests.context_daemon.test_store_blocks import FORMAT, create, payload_for, writes_for

RANKS = [
    dataclasses.replace(FORMAT, layout=f"test:tp={rank}/2", shard=shard_suffix(rank))
    for rank in range(2)
]
UNSHARDED = dataclasses.replace(FORMAT, layout="test:tp=0/1")
TOKENS = list(range(5000, 5000 + 16 * 2 + 5))  # two full blocks and a 5-token tail


def test_suffixes_name_every_rank_but_the_first() -> None:
    assert shard_suffixes(1) == ("",)
    assert shard_suffixes(3) == ("", ":s1.0", ":s2.0")
    assert shard_suffix(0, 1) == ":s0.1"
    first = bytes(range(8))
    keys = {block_key(first, shard) for shard in shard_suffixes(4)}
    assert len(keys) == 4 and all(key.startswith(block_key(first)) for key in keys)


def test_each_rank_reads_back_its_own_shard_and_no_other(
    store: RedisStore, redis_client: redis.Redis | redis.RedisCluster
) -> None:
    request_id = create(store, TOKENS)
    for rank, kv_format in enumerate(RANKS):
        assert store.put_blocks(writes_for(request_id, TOKENS, seed=rank, kv_format=kv_format))
    for rank, kv_format in enumerate(RANKS):
        loaded = store.get_blocks(block_reads(request_id, kv_format, TOKENS), kv_format)
        assert [block.payload for block in loaded if isinstance(block, KVBlock)] == [
            payload_for(index, seed=rank)[: len(block.payload)]
            for index, block in enumerate(loaded)
            if isinstance(block, KVBlock)
        ]
        assert len(loaded) == 3 and all(isinstance(block, KVBlock) for block in loaded)
    reads = block_reads(request_id, FORMAT, TOKENS)
    stored = [
        key
        for read in reads
        for shard in shard_suffixes(2)
        for key in [dataclasses.replace(read, shard=shard).key]
        if redis_client.exists(key)
    ]
    assert len(stored) == len(set(stored)) == 6  # 3 values per rank, 6 keys
    # Every shard's tail is one of the request's keys: its end and its TTL cover them all.
    assert {key for key in stored if ":blk:" not in key} <= set(request_keys(request_id))

    # A worker of another degree reads the plain keys: rank 0's shard, refused by its layout.
    refused = store.get_blocks(block_reads(request_id, UNSHARDED, TOKENS), UNSHARDED)
    assert [block.reason for block in refused if isinstance(block, BlockRejected)] == [
        RejectReason.LAYOUT
    ] * 3
    store.delete_request(request_id)
    assert not store.keys_for_request(request_id)


def test_shard_views_count_what_each_shard_holds(store: RedisStore) -> None:
    tokens = [token + 1000 for token in TOKENS]  # blocks no other test stored
    request_id = create(store, tokens)
    full = [read.prefix_hash for read in block_reads(request_id, FORMAT, tokens) if read.is_full]
    store.put_blocks(writes_for(request_id, tokens, kv_format=RANKS[0]))
    store.put_blocks(writes_for(request_id, tokens[:16], kv_format=RANKS[1]))  # block 0 only

    views = store.shard_views({request_id: full}, shard_suffixes(2))[request_id]

    (first_run, first_tail), (second_run, second_tail) = views
    assert (first_run, second_run) == (2, 1)
    assert first_tail is not None and first_tail.num_tokens == 5
    assert second_tail is None
