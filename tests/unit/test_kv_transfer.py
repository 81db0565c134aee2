"""The asynchronous copy path (worker/kv_transfer.py) on CPU: the pinned-buffer pool's reuse
and bound, the in-order landing of transfers, and CopyStream round trips through the same
calls the connector makes (on CPU every transfer is done when returned; tests/gpu runs the
same calls on CUDA, where they are not)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from worker.kv_copy import VLLM_LAYOUTS, BlockShape, KVCopier, layer_views
from worker.kv_transfer import CopyStream, HostBufferPool, InOrderLanding, Transfer

LAYERS, BLOCKS, HEADS, BLOCK_TOKENS, CONTENT = 3, 8, 2, 16, 32


def test_the_pool_reuses_a_given_buffer_and_falls_back_to_pageable_when_spent() -> None:
    pool = HostBufferPool(pinned=False, max_bytes=1000)
    first = pool.take(600)
    assert first.numel() == 600 and pool.allocated_bytes == 600
    pool.give(first)
    again = pool.take(500)  # cut from the 600-byte buffer given back
    assert again.numel() == 500 and pool.allocated_bytes == 600
    assert again.data_ptr() == first.data_ptr()
    outside = pool.take(600)  # 600 + 600 > 1000: a pageable buffer, counted
    assert pool.pageable_fallbacks == 1 and pool.allocated_bytes == 600
    pool.give(outside)  # not the pool's: let go, never reused
    pool.give(again)
    assert pool.take(600).data_ptr() == first.data_ptr()


class _Gate(Transfer):
    """A transfer that completes when the test says so (an event stand-in)."""

    def __init__(self, log: list[str], name: str) -> None:
        super().__init__()
        self.opened = threading.Event()
        self._log, self._name = log, name

    def done(self) -> bool:
        return self.opened.is_set()

    def wait(self) -> None:
        assert self.opened.wait(10)
        self._log.append(f"{self._name} landed")


def test_landing_keeps_the_order_of_actions_behind_an_unfinished_transfer() -> None:
    log: list[str] = []
    landing = InOrderLanding()
    landing.land(None, lambda: log.append("commit"))
    assert log == ["commit"]  # nothing before it: at once, on this thread
    slow = _Gate(log, "block 0")
    landing.land(slow, lambda: log.append("submit block 0"))
    landing.land(None, lambda: log.append("paused"))  # must not overtake block 0
    landing.land(None, lambda: log.append("release"))
    time.sleep(0.05)
    assert log == ["commit"] and landing.pending == 3
    slow.opened.set()
    assert landing.close(10)
    assert log == ["commit", "block 0 landed", "submit block 0", "paused", "release"]
    assert landing.pending == 0


def test_a_failing_action_is_logged_and_the_landing_goes_on() -> None:
    log: list[str] = []
    landing = InOrderLanding()
    gate = _Gate(log, "t")
    landing.land(gate, lambda: 1 / 0)  # type: ignore[func-returns-value]
    landing.land(None, lambda: log.append("after"))
    gate.opened.set()
    assert landing.close(10)
    assert log == ["t landed", "after"]


@pytest.mark.parametrize("layout", VLLM_LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize(("blocks", "last_tokens"), [([3], 0), ([5, 0, 7], 0), ([2, 6], 9)])
@pytest.mark.parametrize("content", [CONTENT, 6, 3], ids=["int64-wide", "int16-wide", "bytes"])
def test_copy_stream_round_trips_on_cpu_are_bit_exact(
    layout: object, blocks: list[int], last_tokens: int, content: int
) -> None:
    """Content sizes that the copies see as int64, int16 and plain bytes (kv_copy._widened)."""
    shape = BlockShape(HEADS, BLOCK_TOKENS, content)
    copier = KVCopier(layout, shape, LAYERS, "tokens", f"cpu:{layout}")  # type: ignore[arg-type]
    size = LAYERS * BLOCKS * shape.block_bytes
    source_raw = torch.randint(0, 256, (size,), dtype=torch.uint8)
    target_raw = torch.zeros_like(source_raw)
    source = layer_views(source_raw, layout, LAYERS, BLOCKS, shape)  # type: ignore[arg-type]
    target = layer_views(target_raw, layout, LAYERS, BLOCKS, shape)  # type: ignore[arg-type]
    copies = CopyStream("cpu")
    header = 7
    out = torch.zeros(header + copier.value_bytes(len(blocks), last_tokens), dtype=torch.uint8)
    saved = copies.save(copier, source, blocks, last_tokens, out, header)
    assert saved.done()  # no stream on CPU
    saved.finish()
    assert torch.equal(out[header:], copier.gather(source, blocks, last_tokens))
    destination = [(b + 1) % BLOCKS for b in blocks]
    loaded = copies.load(copier, target, destination, out[header:], last_tokens)
    assert loaded.done()
    loaded.finish()
    for position, (src, dst) in enumerate(zip(blocks, destination, strict=True)):
        tokens = last_tokens if last_tokens and position == len(blocks) - 1 else BLOCK_TOKENS
        for s_view, t_view in zip(source, target, strict=True):
            assert torch.equal(t_view[dst, :, :tokens], s_view[src, :, :tokens])
    assert copies.pool.allocated_bytes == 0  # CPU copies need no pinned staging
