"""A migration target of a tensor-parallel worker stages every rank's shard of a block, and
counts a block staged only once all its shards are (a real redis-server; the staging files
on disk)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from store import RedisStore, block_reads
from store.keys import shard_suffix, shard_suffixes
from tests.context_daemon.test_store_blocks import FORMAT, create, payload_for, writes_for
from worker.kv_staging import StagingArea, read_staged, staged_name
from worker.prefetch import prefetch_stage

RANKS = [
    dataclasses.replace(FORMAT, layout=f"test:tp={rank}/2", shard=shard_suffix(rank))
    for rank in range(2)
]


def test_a_block_is_staged_once_every_rank_shard_of_it_is_stored(
    store: RedisStore, tmp_path: Path
) -> None:
    tokens = list(range(7000, 7000 + 16 * 2 + 5))  # two full blocks (and a tail)
    request_id = create(store, tokens)
    store.put_blocks(writes_for(request_id, tokens, seed=0, kv_format=RANKS[0]))
    store.put_blocks(writes_for(request_id, tokens[:16], seed=1, kv_format=RANKS[1]))
    staging = StagingArea(tmp_path / "staging", budget_bytes=10**7, stale_seconds=60)
    shards = shard_suffixes(2)

    first = prefetch_stage(
        store, staging, request_id, FORMAT.model_fingerprint, FORMAT.block_tokens, shards
    )

    assert (first.staged_blocks, first.new_blocks) == (1, 1), "block 1 lacks rank 1's shard"
    assert first.staged_prefix == tuple(tokens[:16])
    (block0, block1) = [read.prefix_hash for read in block_reads(request_id, FORMAT, tokens)][:2]
    for rank, shard in enumerate(shards):
        staged = read_staged(staging.root, staged_name(block0, shard))
        assert staged is not None and bytes(payload_for(0, seed=rank)) in bytes(staged)
    assert read_staged(staging.root, staged_name(block1, shards[0])) is None

    store.put_blocks(writes_for(request_id, tokens, seed=1, kv_format=RANKS[1]))
    second = prefetch_stage(
        store, staging, request_id, FORMAT.model_fingerprint, FORMAT.block_tokens, shards
    )
    assert (second.staged_blocks, second.new_blocks) == (2, 1)
    assert staging.drop(request_id) == 4  # two blocks, two shards each
