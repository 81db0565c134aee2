"""Loads that lie end to end in memory (worker/kv_runs.py): grouped into runs, and a run's one
scatter writes the same bytes as the loads' scatters one by one, in every layout."""

from __future__ import annotations

import pytest
import torch

from worker.kv_copy import VLLM_LAYOUTS, BlockShape, KVCopier, layer_views
from worker.kv_runs import end_to_end
from worker.spot_connector_metadata import BlockLoad

LAYERS, BLOCKS, HEADS, BLOCK_TOKENS, CONTENT = 3, 12, 2, 4, 16
CHUNK_BLOCKS = 2  # a stored chunk: 2 engine blocks


def _copier(layout_name: str = "LBHNC", tail: str = "tokens") -> KVCopier:
    layout = next(layout for layout in VLLM_LAYOUTS if layout.name == layout_name)
    shape = BlockShape(HEADS, BLOCK_TOKENS, CONTENT, element_bytes=2, head_dim=4)
    return KVCopier(layout, shape, LAYERS, tail, f"cpu:{layout_name}")


def _file(copier: KVCopier, tokens: list[int], gap_after: int = -1) -> list[memoryview]:
    """Chunk values of ``tokens`` each, one after another in one buffer (as the fetcher lays
    them out), with 7 stray bytes after chunk ``gap_after``."""
    sizes = [copier.value_bytes(*copier.last_block_tokens(n)) for n in tokens]
    whole = bytearray(torch.randint(0, 256, (sum(sizes) + 7,), dtype=torch.uint8).numpy())
    view, at, values = memoryview(whole), 0, []
    for i, size in enumerate(sizes):
        values.append(view[at : at + size])
        at += size + (7 if i == gap_after else 0)
    return values


def _loads(values: list[memoryview], tokens: list[int], first_block: int = 0) -> list[BlockLoad]:
    loads, slot = [], 0
    for i, (value, count) in enumerate(zip(values, tokens, strict=True)):
        blocks = -(-count // BLOCK_TOKENS) - (first_block if i == 0 else 0)
        slots = tuple(BLOCKS - 1 - s for s in range(slot, slot + blocks))  # scattered, reversed
        slot += blocks
        loads.append(
            BlockLoad(
                block_ids=slots,
                payloads=(value,),
                num_tokens=count,
                first_block=first_block if i == 0 else 0,
            )
        )
    return loads


def _scattered(copier: KVCopier, runs: list[tuple[torch.Tensor, list[int], int]]) -> torch.Tensor:
    raw = torch.zeros(LAYERS * BLOCKS * HEADS * BLOCK_TOKENS * CONTENT, dtype=torch.uint8)
    views = layer_views(raw, copier.layout, LAYERS, BLOCKS, copier.shape)
    for value, block_ids, last in runs:
        copier.scatter(views, block_ids, value, last)
    return raw


def _one_by_one(copier: KVCopier, loads: list[BlockLoad]) -> torch.Tensor:
    runs = []
    for load in loads:
        single = list(end_to_end(copier, 0, [load]))
        assert len(single) == 1
        runs.append((single[0].value(), single[0].block_ids, single[0].last))
    return _scattered(copier, runs)


@pytest.mark.parametrize("layout", [layout.name for layout in VLLM_LAYOUTS])
def test_whole_chunks_side_by_side_are_one_run_that_scatters_the_same_bytes(layout: str) -> None:
    copier = _copier(layout)
    tokens = [CHUNK_BLOCKS * BLOCK_TOKENS] * 4 + [5]  # the last: a partial tail
    loads = _loads(_file(copier, tokens), tokens)
    runs = list(end_to_end(copier, 0, loads))
    assert [len(run.loads) for run in runs] == [5]
    (run,) = runs
    assert run.last == 1 and len(run.block_ids) == 10
    assert torch.equal(_scattered(copier, [(run.value(), run.block_ids, run.last)]),
                       _one_by_one(copier, loads))  # fmt: skip


def test_a_gap_in_memory_starts_a_new_run() -> None:
    copier = _copier()
    tokens = [CHUNK_BLOCKS * BLOCK_TOKENS] * 4
    loads = _loads(_file(copier, tokens, gap_after=1), tokens)
    runs = list(end_to_end(copier, 0, loads))
    assert [len(run.loads) for run in runs] == [2, 2]
    merged = [(run.value(), run.block_ids, run.last) for run in runs]
    assert torch.equal(_scattered(copier, merged), _one_by_one(copier, loads))


def test_a_partial_block_ends_its_run() -> None:
    """A value whose last block is partial is followed in memory by the next value, but
    its tail is shorter than a block: the next chunk cannot be read as more of it."""
    copier = _copier(tail="kt-v")
    tokens = [CHUNK_BLOCKS * BLOCK_TOKENS - 1, CHUNK_BLOCKS * BLOCK_TOKENS]
    loads = _loads(_file(copier, tokens), tokens)
    runs = list(end_to_end(copier, 0, loads))
    assert [len(run.loads) for run in runs] == [1, 1]
    merged = [(run.value(), run.block_ids, run.last) for run in runs]
    assert torch.equal(_scattered(copier, merged), _one_by_one(copier, loads))


def test_a_first_load_that_starts_past_its_cached_blocks_still_joins_the_next() -> None:
    copier = _copier()
    tokens = [CHUNK_BLOCKS * BLOCK_TOKENS] * 3
    loads = _loads(_file(copier, tokens), tokens, first_block=1)
    runs = list(end_to_end(copier, 0, loads))
    assert [len(run.loads) for run in runs] == [3]
    assert len(runs[0].block_ids) == 5
    merged = [(run.value(), run.block_ids, run.last) for run in runs]
    assert torch.equal(_scattered(copier, merged), _one_by_one(copier, loads))


def test_a_run_stops_short_of_the_largest_size_asked() -> None:
    copier = _copier()
    tokens = [CHUNK_BLOCKS * BLOCK_TOKENS] * 5
    loads = _loads(_file(copier, tokens), tokens)
    chunk_bytes = copier.value_bytes(CHUNK_BLOCKS)
    runs = list(end_to_end(copier, 0, loads, largest=2 * chunk_bytes))
    assert [len(run.loads) for run in runs] == [2, 2, 1]
    merged = [(run.value(), run.block_ids, run.last) for run in runs]
    assert torch.equal(_scattered(copier, merged), _one_by_one(copier, loads))
