"""The connector's scheduler side names chunks of several engine blocks: which cache slots a
save copies, which a load fills (after a local prefix-cache hit that ends inside a chunk),
and what a pause flushes. In-memory fakes for vLLM's request and the store; the copy itself
is tested in tests/worker/test_kv_copy_layouts.py and the whole path by the resume tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from vllm.v1.request import RequestStatus

from store import BlockRejected, KVBlock, KVFormat, RejectReason
from store.block_refs import BlockRead
from store.keys import shard_suffix
from worker.constants import KV_PARAM_REQUEST_ID, KV_PARAM_RESUME
from worker.spot_connector_scheduler import SpotConnectorScheduler

ENGINE_BLOCK, CHUNK = 128, 256
FORMAT = KVFormat("model-fp", "float32", "test-layout", 2, CHUNK)


class FakeStore:
    """Holds every chunk asked for (the tail too); counts nothing else."""

    keyring = None

    def get_blocks(self, reads: Sequence[BlockRead], kv_format: KVFormat) -> list[KVBlock]:
        return [KVBlock(kv_format, read.prefix_hash, read.num_tokens, b"kv") for read in reads]

    def close(self) -> None:
        pass


def _scheduler(kv_load: str = "sync", store: Any = None) -> SpotConnectorScheduler:
    spec = SimpleNamespace(block_size=ENGINE_BLOCK, page_size_bytes=1000)
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
    return SpotConnectorScheduler(
        config,  # type: ignore[arg-type]
        FORMAT,
        "eager",
        store or FakeStore(),
        None,
        kv_load=kv_load,
    )


def _request(tokens: int, computed: int, resume: bool = False) -> Any:
    return SimpleNamespace(
        request_id="vllm-1",
        kv_transfer_params={KV_PARAM_REQUEST_ID: "req-1", KV_PARAM_RESUME: resume},
        all_token_ids=[(7 * n) % 500 + 1 for n in range(tokens)],
        num_computed_tokens=computed,
        output_token_ids=[1, 2],
        status=RequestStatus.RUNNING,
    )


def test_a_resume_loads_the_blocks_after_a_local_hit_inside_the_first_chunk() -> None:
    scheduler = _scheduler()
    request = _request(600, 0, resume=True)
    scheduler.on_new_request(request)
    matched, asynchronous = scheduler.get_num_new_matched_tokens(request, ENGINE_BLOCK)
    assert (matched, asynchronous) == (599 - ENGINE_BLOCK, False)
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13, 14],))
    scheduler.update_state_after_alloc(request, blocks, matched)  # type: ignore[arg-type]
    loads = scheduler.build_connector_meta(
        SimpleNamespace(  # type: ignore[arg-type]
            num_scheduled_tokens={}, kv_connector_block_state=None
        )
    ).loads
    assert [(load.block_ids, load.first_block, load.num_tokens) for load in loads] == [
        ((11,), 1, CHUNK),  # chunk 0: its first block was the local hit
        ((12, 13), 0, CHUNK),
        ((14,), 0, 599 - 2 * CHUNK),  # the tail a pause stored: every token but the last
    ]


def test_a_chunk_is_saved_once_full_with_the_slots_of_its_blocks() -> None:
    scheduler = _scheduler()
    request = _request(300, 0)
    scheduler.on_new_request(request)
    state = SimpleNamespace(get_block_ids=lambda vllm_id: ([5, 6, 7],))
    output = SimpleNamespace(num_scheduled_tokens={"vllm-1": 300}, kv_connector_block_state=state)
    saves = scheduler.build_connector_meta(output).saves  # type: ignore[arg-type]
    assert [(save.block_index, save.block_ids, save.num_tokens) for save in saves] == [
        (0, (5, 6), 0)
    ]
    request.num_computed_tokens = 300
    output.num_scheduled_tokens = {"vllm-1": 1}
    assert not scheduler.build_connector_meta(output).saves  # type: ignore[arg-type]


def test_a_pause_flushes_the_full_chunks_and_the_partial_one() -> None:
    scheduler = _scheduler()
    request = _request(701, 700)
    scheduler.on_new_request(request)
    request.status = RequestStatus.FINISHED_ABORTED
    delay_free, _ = scheduler.request_finished(request, [20, 21, 22, 23, 24, 25])  # type: ignore[arg-type]
    assert delay_free
    output = SimpleNamespace(num_scheduled_tokens={}, kv_connector_block_state=None)
    saves = scheduler.build_connector_meta(output).saves  # type: ignore[arg-type]
    assert [(save.block_index, save.block_ids, save.num_tokens) for save in saves] == [
        (0, (20, 21), 0),
        (1, (22, 23), 0),
        (2, (24, 25), 700 - 2 * CHUNK),  # 188 tokens: one full engine block and 60 of the next
    ]
    assert all(save.required for save in saves)


class ShardStore(FakeStore):
    """Holds each rank's shard as the rank's suffix; ``missing``: (shard, block index) pairs
    it does not hold."""

    def __init__(self, missing: set[tuple[str, int]]) -> None:
        self.missing = missing

    def get_blocks(
        self, reads: Sequence[BlockRead], kv_format: KVFormat
    ) -> list[KVBlock | BlockRejected]:
        return [
            BlockRejected(read.name, RejectReason.MISSING, "absent")
            if (read.shard, read.block_index) in self.missing
            else KVBlock(kv_format, read.prefix_hash, read.num_tokens, f"kv{read.shard}".encode())
            for read in reads
        ]


def _sharded_loads(store: ShardStore) -> list[Any]:
    formats = [dataclasses.replace(FORMAT, shard=shard_suffix(rank)) for rank in range(2)]
    spec = SimpleNamespace(block_size=ENGINE_BLOCK, page_size_bytes=1000)
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
    scheduler = SpotConnectorScheduler(
        config,  # type: ignore[arg-type]
        FORMAT,
        "eager",
        store,  # type: ignore[arg-type]
        None,
        kv_load="sync",
        shard_formats=formats,
    )
    request = _request(600, 0, resume=True)
    scheduler.on_new_request(request)
    matched, _ = scheduler.get_num_new_matched_tokens(request, 0)
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13, 14],))
    scheduler.update_state_after_alloc(request, blocks, matched)  # type: ignore[arg-type]
    output = SimpleNamespace(num_scheduled_tokens={}, kv_connector_block_state=None)
    return scheduler.build_connector_meta(output).loads  # type: ignore[arg-type]


def test_a_tensor_parallel_resume_hands_each_rank_its_own_shard() -> None:
    loads = _sharded_loads(ShardStore(set()))
    assert [load.payloads for load in loads] == [(b"kv", b"kv:s1.0")] * 3


def test_a_block_with_a_missing_shard_ends_what_a_resume_loads() -> None:
    loads = _sharded_loads(ShardStore({(":s1.0", 1)}))
    assert [(load.block_ids, load.payloads) for load in loads] == [((10, 11), (b"kv", b"kv:s1.0"))]
