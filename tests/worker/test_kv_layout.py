"""The KV block layout against vLLM-CPU's real cache-write kernel.

A ``kt-v`` tail (kv_copy.py) assumes where the kernel puts each token of a block. Checked
without that assumption: a cache slot that gets the tail's columns through the copier's
gather and scatter must end byte for byte as if the kernel had written those tokens into it
itself, whatever was in the slot before.
"""

from __future__ import annotations

import pytest
import torch

from worker.kv_copy import VLLM_LAYOUTS, BlockShape, KVCopier
from worker.kv_layout import TOKEN_COLUMN_ISAS, host_tensor

HEADS, BLOCK_TOKENS, HEAD_DIM, LAYERS, HEADER = 3, 128, 64, 2, 7


def _write_tokens(
    cache: torch.Tensor, block_id: int, key: torch.Tensor, value: torch.Tensor, isa: str
) -> None:
    """The attention layer's own cache write: tokens 0..n-1 of block ``block_id``."""
    from vllm import _custom_ops as ops

    blocks = cache.view(cache.shape[0], HEADS, BLOCK_TOKENS * 2, HEAD_DIM)
    key_cache, value_cache = blocks.chunk(2, dim=2)
    start = block_id * BLOCK_TOKENS
    slots = torch.arange(start, start + key.shape[0], dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)


def _copier(dtype: torch.dtype, tail_rule: str) -> KVCopier:
    element = torch.empty((), dtype=dtype).element_size()
    shape = BlockShape(HEADS, BLOCK_TOKENS, 2 * HEAD_DIM * element, element, HEAD_DIM)
    return KVCopier(VLLM_LAYOUTS[0], shape, LAYERS, tail_rule, f"test:{tail_rule}")


def _garbage(generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    shape = (4, HEADS, BLOCK_TOKENS, 2 * HEAD_DIM)
    return torch.randn(shape, generator=generator).to(dtype)


@pytest.mark.parametrize("isa", sorted(TOKEN_COLUMN_ISAS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 37, BLOCK_TOKENS - 1])
def test_a_trimmed_tail_lands_where_the_kernel_writes_it(
    isa: str, dtype: torch.dtype, num_tokens: int
) -> None:
    generator = torch.Generator().manual_seed(num_tokens)
    copier = _copier(dtype, "kt-v")
    keys, values = (
        [
            torch.randn(num_tokens, HEADS, HEAD_DIM, generator=generator).to(dtype)
            for _ in range(LAYERS)
        ]
        for _ in ("keys", "values")
    )

    source = [_garbage(generator, dtype) for _ in range(LAYERS)]
    for layer in range(LAYERS):
        _write_tokens(source[layer], 1, keys[layer], values[layer], isa)
    copied = copier.gather(source, [1], num_tokens, HEADER)
    payload = copied[HEADER:].numpy().tobytes()
    element = torch.empty((), dtype=dtype).element_size()
    assert len(payload) == LAYERS * copier.tail_layer_bytes(num_tokens)
    assert len(payload) < LAYERS * HEADS * BLOCK_TOKENS * 2 * HEAD_DIM * element

    target = [_garbage(generator, dtype) for _ in range(LAYERS)]
    expected = [layer.clone() for layer in target]
    copier.scatter(target, [2], host_tensor(memoryview(payload)), num_tokens)
    for layer in range(LAYERS):
        _write_tokens(expected[layer], 2, keys[layer], values[layer], isa)
        assert torch.equal(target[layer].view(torch.uint8), expected[layer].view(torch.uint8))


def test_full_blocks_and_unknown_kernels_stay_whole() -> None:
    tensors = [torch.randn(2, HEADS, BLOCK_TOKENS, 2 * HEAD_DIM) for _ in range(LAYERS)]
    whole = LAYERS * tensors[0][0].numel() * tensors[0].element_size()
    for copier, num_tokens in [
        (_copier(torch.float32, "kt-v"), 0),  # a full block
        (_copier(torch.float32, "whole"), 5),  # AMX (K packed in tiles) or a kernel not known
    ]:
        assert copier.gather(tensors, [1], num_tokens, HEADER).numel() == HEADER + whole
    with pytest.raises(ValueError, match="ending with 5 tokens"):
        _copier(torch.float32, "kt-v").scatter(tensors, [0], torch.zeros(100, dtype=torch.uint8), 5)
