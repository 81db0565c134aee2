"""The asynchronous copy path (worker/kv_transfer.py) on CUDA tensors in every layout vLLM
0.32 defines: saves on a side stream into pinned buffers (from the pool, or the caller's own
pinned buffer), loads that the compute stream waits for, the landing that hands a block on
only once its bytes are on the host. No vLLM needed; skipped where there is no CUDA device.

Ordering is checked with work the GPU is made to wait on (``torch.cuda._sleep``): a save must
see what the compute stream wrote before it, and must return to the host before its copy is
done; nothing is timed.
"""

from __future__ import annotations

import pytest
import torch

from worker.kv_copy import VLLM_LAYOUTS, BlockShape, CacheLayout, KVCopier, layer_views
from worker.kv_transfer import CopyStream, InOrderLanding

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the GPU copy path needs one"
)

LAYERS, BLOCKS, HEADS, BLOCK_TOKENS, HEAD_DIM = 4, 12, 2, 16, 64
SPIN_CYCLES = 1_000_000_000  # ~0.5 s of GPU time: long enough that a host call returns first


def _cache(layout: CacheLayout, seed: int) -> tuple[KVCopier, list[torch.Tensor], torch.Tensor]:
    shape = BlockShape(HEADS, BLOCK_TOKENS, 2 * HEAD_DIM * 2, 2, HEAD_DIM)
    copier = KVCopier(layout, shape, LAYERS, "tokens", f"cuda:{layout.name}")
    generator = torch.Generator(device="cuda").manual_seed(seed)
    size = LAYERS * BLOCKS * shape.block_bytes
    raw = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda", generator=generator)
    return copier, layer_views(raw, layout, LAYERS, BLOCKS, shape), raw


@pytest.mark.parametrize("layout", VLLM_LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("destination", ["pageable", "pinned"])
@pytest.mark.parametrize(("blocks", "last_tokens"), [([3], 0), ([7, 1, 4], 0), ([0, 11, 6], 5)])
def test_a_side_stream_round_trip_is_bit_exact(
    layout: CacheLayout, destination: str, blocks: list[int], last_tokens: int
) -> None:
    copier, source, _ = _cache(layout, 1)
    _, target, _ = _cache(layout, 2)
    copies = CopyStream("cuda")
    header = 16
    nbytes = header + copier.value_bytes(len(blocks), last_tokens)
    out = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=destination == "pinned")
    landed: list[torch.Tensor] = []
    landing = InOrderLanding()
    saved = copies.save(copier, source, blocks, last_tokens, out, header)
    landing.land(saved, lambda: landed.append(out.clone()))
    assert landing.close(30) and len(landed) == 1
    reference = copier.gather(source, blocks, last_tokens)
    assert torch.equal(landed[0][header:], reference)
    assert copies.pool.allocated_bytes == (nbytes if destination == "pageable" else 0)
    spots = [(b + 5) % BLOCKS for b in blocks]
    loaded = copies.load(copier, target, spots, out[header:], last_tokens)
    check = [view[spots].clone() for view in target]  # on the compute stream: after the load
    loaded.finish()
    torch.cuda.synchronize()
    for position, (src, dst) in enumerate(zip(blocks, spots, strict=True)):
        tokens = last_tokens if last_tokens and position == len(blocks) - 1 else BLOCK_TOKENS
        for s_view, seen in zip(source, check, strict=True):
            assert torch.equal(seen[position, :, :tokens], s_view[src, :, :tokens])
        for s_view, t_view in zip(source, target, strict=True):
            assert torch.equal(t_view[dst, :, :tokens], s_view[src, :, :tokens])


@pytest.mark.parametrize("layout", VLLM_LAYOUTS, ids=lambda layout: layout.name)
def test_a_save_waits_for_the_forward_pass_but_not_the_host(layout: CacheLayout) -> None:
    copier, source, raw = _cache(layout, 3)
    copies = CopyStream("cuda")
    out = torch.empty(copier.value_bytes(2), dtype=torch.uint8)
    # Warm: the pinned buffer and the side stream's device memory exist beforehand, as in a
    # running worker (a first allocation on a new stream may synchronise the device).
    copies.save(copier, source, [2, 9], 0, out).finish()
    torch.cuda._sleep(1000)  # the spin and fill kernels loaded too (a first launch may wait)
    raw.fill_(0)
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)  # a long "forward pass" on the compute stream ...
    raw.fill_(0xA5)  # ... that writes the cache last
    saved = copies.save(copier, source, [2, 9], 0, out)
    assert not saved.done()  # the host got control back while the GPU still works
    saved.finish()
    assert bool((out == 0xA5).all())  # the copy ran after the write, not before


def test_the_pool_serves_many_saves_and_gets_its_buffers_back() -> None:
    copier, source, _ = _cache(VLLM_LAYOUTS[0], 4)
    copies = CopyStream("cuda", pool_bytes=4 * copier.value_bytes(3))
    landing = InOrderLanding()
    outs = [torch.empty(copier.value_bytes(3), dtype=torch.uint8) for _ in range(32)]
    for index, out in enumerate(outs):
        blocks = [(index + k) % BLOCKS for k in range(3)]
        landing.land(copies.save(copier, source, blocks, 0, out))
    assert landing.close(60)
    for index, out in enumerate(outs):
        blocks = [(index + k) % BLOCKS for k in range(3)]
        assert torch.equal(out, copier.gather(source, blocks))
    assert copies.pool.allocated_bytes <= 4 * copier.value_bytes(3)
    assert copies.pool.take(copier.value_bytes(3)).is_pinned()


@pytest.mark.parametrize("layout", VLLM_LAYOUTS, ids=lambda layout: layout.name)
def test_a_load_returns_at_once_and_the_next_forward_pass_sees_it(layout: CacheLayout) -> None:
    copier, source, _ = _cache(layout, 5)
    _, target, _ = _cache(layout, 6)
    value = copier.gather(source, [1, 8], 3)
    copies = CopyStream("cuda")
    copies.load(copier, target, [4, 10], value, 3).finish()  # warm, as in a running worker
    target[0].zero_()
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)  # the step before is still running on the GPU
    loaded = copies.load(copier, target, [4, 10], value, 3)
    assert not loaded.done()
    after = [view[[4, 10]].clone() for view in target]  # the next step, on the compute stream
    loaded.finish()
    torch.cuda.synchronize()
    for s_view, seen in zip(source, after, strict=True):
        assert torch.equal(seen[0], s_view[1])
        assert torch.equal(seen[1, :, :3], s_view[8, :, :3])
