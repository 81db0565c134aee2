"""The copy path (worker/kv_copy.py) on CPU caches laid out in every KVCacheLayout of the
installed vLLM, built with vLLM's own helpers (compute_layout_strides, create_kv_cache_views),
so the strides are vLLM's and not a guess: save -> load is bit-exact for single blocks, runs
of blocks and partial tails, and a value of one layout is refused by a reader of another.
No engine starts here."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from store import BlockRejected, RejectReason
from store.block_codec import decode_block, header_bytes, seal_block
from worker.kv_copy import VLLM_LAYOUTS, KVCopier, LayoutMismatch, as_bytes, layer_views
from worker.kv_layout import (
    ParallelPlace,
    UnsupportedKVCache,
    attention_spec,
    block_buffer,
    check_tensors,
    copier_for,
    host_tensor,
    kv_format_for,
)

LAYERS, BLOCKS, HEADS, BLOCK_TOKENS, HEAD_DIM = 3, 6, 2, 16, 8
ALL_LAYOUTS = list(KVCacheLayout)


def _spec(dtype: torch.dtype = torch.bfloat16) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=BLOCK_TOKENS, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=dtype
    )


def _vllm_cache(
    layout: KVCacheLayout, spec: FullAttentionSpec, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A random backing buffer and vLLM's per-layer views of it."""
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    size = LAYERS * BLOCKS * spec.page_size_bytes
    tensor = KVCacheTensor(
        size=size,
        layers=[f"layer.{index}" for index in range(LAYERS)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=_generator(seed))
    views = create_kv_cache_views(raw.view(torch.int8), spec, BLOCKS, layout, tensor)
    return raw, views


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _config(layout: KVCacheLayout, spec: FullAttentionSpec, groups: int = 1) -> SimpleNamespace:
    group = SimpleNamespace(
        kv_cache_spec=spec, layer_names=[f"layer.{index}" for index in range(LAYERS)]
    )
    return SimpleNamespace(
        kv_cache_groups=[group] * groups, kv_cache_layout=layout.name, num_blocks=BLOCKS
    )


def _copier(
    layout: KVCacheLayout, spec: FullAttentionSpec, device: str = "cuda", tp: int = 1
) -> KVCopier:
    """The connector's copier as a GPU platform derives it (tail rule ``tokens``)."""
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_layout=layout.name))
    return copier_for(
        _config(layout, spec), vllm_config, device, ParallelPlace(0, tp), backend="TEST_ATTN"
    )


def _block_bytes(views: list[torch.Tensor], block_id: int, tokens: int) -> list[bytes]:
    return [bytes(view[block_id, :, :tokens].contiguous().numpy()) for view in as_bytes(views)]


def test_the_layouts_as_data_are_vllms() -> None:
    assert [(layout.name, layout.stride_order) for layout in VLLM_LAYOUTS] == [
        (member.name, member.stride_order) for member in KVCacheLayout
    ]
    for ours, member in zip(VLLM_LAYOUTS, KVCacheLayout, strict=True):
        assert ours.is_block_contiguous == member.is_block_contiguous
        assert ours.is_block_outermost == member.is_block_outermost


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda layout: layout.name)
def test_our_views_have_vllms_strides(layout: KVCacheLayout) -> None:
    spec = _spec()
    raw, views = _vllm_cache(layout, spec, 1)
    copier = _copier(layout, spec)
    ours = layer_views(raw, copier.layout, LAYERS, BLOCKS, copier.shape)
    for theirs, mine in zip(as_bytes(views), ours, strict=True):
        assert theirs.stride() == mine.stride()
        assert theirs.data_ptr() == mine.data_ptr()


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize(
    ("block_ids", "last_tokens"),
    [([4], 0), ([5, 0, 3], 0), ([2], 5), ([1, 5, 2], 11), ([3], BLOCK_TOKENS - 1)],
    ids=["block", "run", "tail", "run-with-tail", "tail-minus-one"],
)
def test_save_then_load_is_bit_exact(
    layout: KVCacheLayout, block_ids: list[int], last_tokens: int
) -> None:
    spec = _spec()
    source_raw, source = _vllm_cache(layout, spec, 2)
    target_raw, target = _vllm_cache(layout, spec, 3)
    before = target_raw.clone()
    copier = _copier(layout, spec)
    value = copier.gather(source, block_ids, last_tokens, header_bytes=9)[9:]
    assert value.numel() == copier.value_bytes(len(block_ids), last_tokens)
    destination = [(index + 1) % BLOCKS for index in block_ids]
    copier.scatter(target, destination, value, last_tokens, copier.descriptor)

    for position, (src, dst) in enumerate(zip(block_ids, destination, strict=True)):
        last = position == len(block_ids) - 1
        tokens = last_tokens if last and last_tokens else BLOCK_TOKENS
        assert _block_bytes(target, dst, tokens) == _block_bytes(source, src, tokens)
    # Nothing else moved: every byte outside the written tokens is as before.
    written = torch.zeros_like(target_raw, dtype=torch.bool)
    marks = layer_views(written.view(torch.uint8), copier.layout, LAYERS, BLOCKS, copier.shape)
    for position, dst in enumerate(destination):
        last = position == len(block_ids) - 1
        tokens = last_tokens if last and last_tokens else BLOCK_TOKENS
        for mark in marks:
            mark[dst, :, :tokens] = 1
    assert torch.equal(target_raw[~written], before[~written])


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda layout: layout.name)
def test_a_tail_holds_only_its_filled_tokens(layout: KVCacheLayout) -> None:
    spec = _spec()
    _, source = _vllm_cache(layout, spec, 4)
    copier = _copier(layout, spec)
    whole = copier.gather(source, [1]).numel()
    assert copier.gather(source, [1], 3).numel() * BLOCK_TOKENS == whole * 3


@pytest.mark.parametrize(
    ("written", "read"),
    list(itertools.permutations(ALL_LAYOUTS, 2))[::5],
    ids=lambda layout: layout.name,
)
def test_a_value_of_another_layout_is_refused(written: KVCacheLayout, read: KVCacheLayout) -> None:
    spec = _spec()
    _, source = _vllm_cache(written, spec, 5)
    _, target = _vllm_cache(read, spec, 6)
    writer, reader = _copier(written, spec), _copier(read, spec)
    value = writer.gather(source, [0, 1])
    with pytest.raises(LayoutMismatch, match=f"layout={written.name}"):
        reader.scatter(target, [0, 1], value, descriptor=writer.descriptor)

    # Through the store's codec: the reader's KVFormat rejects the stored block (LAYOUT).
    write_format = kv_format_for(_config(written, spec), "model", writer)
    read_format = kv_format_for(_config(read, spec), "model", reader)
    prefix = bytes(16)
    data = writer.gather(source, [0], header_bytes=header_bytes(write_format))
    sealed = seal_block(block_buffer(data), write_format, prefix, BLOCK_TOKENS)
    assert decode_block("b", sealed.data, write_format, prefix, BLOCK_TOKENS).is_full
    with pytest.raises(BlockRejected) as rejected:
        decode_block("b", sealed.data, read_format, prefix, BLOCK_TOKENS)
    assert rejected.value.reason is RejectReason.LAYOUT


def test_the_layout_string_names_what_a_reader_must_share() -> None:
    spec = _spec(torch.float16)
    descriptor = _copier(KVCacheLayout.BLNHC, spec, tp=2).descriptor
    for part in ("backend=TEST_ATTN", "layout=BLNHC", "block=16", "dtype=float16", "tp=0/2"):
        assert part in descriptor
    assert "form=block-major" in descriptor and "tail=tokens" in descriptor
    single = _copier(KVCacheLayout.BLNHC, spec, tp=1).descriptor
    assert single != descriptor  # another TP degree: another string, so refused


def test_a_stored_value_loads_from_a_read_only_buffer() -> None:
    spec = _spec(torch.float32)
    layout = KVCacheLayout.LHBNC
    _, source = _vllm_cache(layout, spec, 7)
    _, target = _vllm_cache(layout, spec, 8)
    copier = _copier(layout, spec)
    stored = bytes(copier.gather(source, [2, 3], 7).numpy())
    copier.scatter(target, [0, 1], host_tensor(memoryview(stored)), 7)
    assert _block_bytes(target, 1, 7) == _block_bytes(source, 3, 7)


def test_the_cache_is_checked_against_the_copier() -> None:
    spec = _spec()
    _, views = _vllm_cache(KVCacheLayout.BHLNC, spec, 9)
    copier = _copier(KVCacheLayout.BHLNC, spec)
    check_tensors(views, BLOCKS, copier)
    with pytest.raises(UnsupportedKVCache, match="is not a"):
        check_tensors([view[:, :1] for view in views], BLOCKS, copier)
    with pytest.raises(UnsupportedKVCache, match="2 KV tensors for 3 layers"):
        check_tensors(views[:2], BLOCKS, copier)


def test_several_cache_groups_are_refused_with_their_names() -> None:
    with pytest.raises(UnsupportedKVCache, match=r"2: group 0: FullAttentionSpec .*layer\.0"):
        attention_spec(_config(KVCacheLayout.LBHNC, _spec(), groups=2))


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("chunk_tokens", [4 * BLOCK_TOKENS, 3 * BLOCK_TOKENS + 5])
def test_a_chunk_loads_in_parts_where_a_local_hit_holds_its_first_blocks(
    layout: KVCacheLayout, chunk_tokens: int
) -> None:
    """A stored chunk (full, or a pause's partial one) written into the slots after the ones
    vLLM's prefix cache already had: only those blocks change, bit for bit."""
    spec = _spec()
    _, source = _vllm_cache(layout, spec, 10)
    _, target = _vllm_cache(layout, spec, 11)
    copier = _copier(layout, spec)
    blocks, last = copier.last_block_tokens(chunk_tokens)
    assert (blocks, last) == (4, chunk_tokens % BLOCK_TOKENS)
    value = copier.gather(source, [0, 1, 2, 3], last)
    cached = [bytes(view[5].contiguous().numpy()) for view in as_bytes(target)]
    part, part_last = copier.part(value, blocks, last, 2, 2)
    copier.scatter(target, [3, 4], part, part_last)
    assert _block_bytes(target, 3, BLOCK_TOKENS) == _block_bytes(source, 2, BLOCK_TOKENS)
    tokens = last or BLOCK_TOKENS
    assert _block_bytes(target, 4, tokens) == _block_bytes(source, 3, tokens)
    assert [bytes(view[5].contiguous().numpy()) for view in as_bytes(target)] == cached
    head, head_last = copier.part(value, blocks, last, 0, 1)
    assert head.numel() == LAYERS * copier.shape.block_bytes and head_last == 0
