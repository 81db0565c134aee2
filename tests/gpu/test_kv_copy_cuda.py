"""The KV copy path (worker/kv_copy.py) on CUDA tensors in every layout vLLM 0.32 defines: no
vLLM needed, only PyTorch with a CUDA device; skipped where there is none.

Round trips device -> host -> device are bit-exact for single blocks, runs of blocks and
partial tails, into pageable and pinned host buffers; the last test measures pinned vs
pageable copy rates and records them (no timing is asserted: the figures go to the report,
see docs/benchmarks.md and benchmarks/gpu_kv_copy.py for the full measurement).
"""

from __future__ import annotations

import time

import pytest
import torch

from worker.kv_copy import VLLM_LAYOUTS, BlockShape, CacheLayout, KVCopier, layer_views

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the GPU copy path needs one"
)

LAYERS, BLOCKS, HEADS, BLOCK_TOKENS, HEAD_DIM = 4, 12, 2, 16, 64
MB = 1_000_000


def _cache(
    layout: CacheLayout, dtype: torch.dtype, seed: int
) -> tuple[KVCopier, list, torch.Tensor]:
    element = torch.empty((), dtype=dtype).element_size()
    shape = BlockShape(HEADS, BLOCK_TOKENS, 2 * HEAD_DIM * element, element, HEAD_DIM)
    copier = KVCopier(layout, shape, LAYERS, "tokens", f"cuda:{layout.name}")
    generator = torch.Generator(device="cuda").manual_seed(seed)
    size = LAYERS * BLOCKS * shape.block_bytes
    raw = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda", generator=generator)
    views = [view.view(dtype) for view in layer_views(raw, layout, LAYERS, BLOCKS, shape)]
    return copier, views, raw


@pytest.mark.parametrize("layout", VLLM_LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
@pytest.mark.parametrize(
    ("blocks", "last_tokens"), [([3], 0), ([7, 1, 4], 0), ([5], 9), ([0, 11, 6, 2], 1)]
)
def test_a_cuda_round_trip_is_bit_exact(
    layout: CacheLayout, dtype: torch.dtype, pinned: bool, blocks: list[int], last_tokens: int
) -> None:
    copier, source, _ = _cache(layout, dtype, 1)
    _, target, target_raw = _cache(layout, dtype, 2)
    before = target_raw.clone()
    value = copier.gather(source, blocks, last_tokens, pin_memory=pinned)
    assert value.device.type == "cpu" and value.is_pinned() == pinned
    assert value.numel() == copier.value_bytes(len(blocks), last_tokens)
    destination = [(block + 5) % BLOCKS for block in blocks]
    copier.scatter(target, destination, value, last_tokens)
    torch.cuda.synchronize()
    for position, (src, dst) in enumerate(zip(blocks, destination, strict=True)):
        tokens = last_tokens if last_tokens and position == len(blocks) - 1 else BLOCK_TOKENS
        for s_view, t_view in zip(source, target, strict=True):
            assert torch.equal(
                t_view[dst, :, :tokens].view(torch.uint8), s_view[src, :, :tokens].view(torch.uint8)
            )
    changed = (target_raw != before).sum().item()
    assert changed <= sum(
        LAYERS * HEADS * BLOCK_TOKENS * copier.shape.content_bytes for _ in blocks
    )


def test_pinned_and_pageable_copy_rates_are_measured(
    record_property: pytest.RecordProperty,
) -> None:
    """Both copies move the same bytes; their rates are recorded (pinned is expected faster,
    but a test asserts no timing)."""
    size = 256 * MB
    device = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    for pinned in (False, True):
        host = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        host.copy_(device)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        host.copy_(device)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        assert torch.equal(host[:4096].cuda(), device[:4096])
        name = "pinned" if pinned else "pageable"
        record_property(f"d2h_mb_per_second_{name}", round(size / seconds / MB))
        print(f"device -> host, {name}: {size / seconds / MB:.0f} MB/s")
