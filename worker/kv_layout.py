"""How one KV block of vLLM's paged cache becomes bytes in the store, and back.

vLLM-CPU keeps one tensor per attention layer, blocks first::

    layer tensor [num_blocks, kv_heads, block_tokens, 2 * head_dim]
    inside one block, per head:  K^T [head_dim x block_tokens] | V [block_tokens x head_dim]

The shape claims a token axis that the data does not follow (K is stored transposed), so a
block is only ever copied whole: its bytes are opaque here, and only another engine with the
same layout may read them. The payload of a block is every layer's block, in layer order::

    payload = layer[0][block_id] bytes | layer[1][block_id] bytes | ...

The layout string names the platform and the per-block geometry; a reader whose string
differs rejects the block (the store checks it) instead of misreading it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from context_daemon.store import KVFormat
from context_daemon.store.block_codec import Buffer


def attention_spec(kv_cache_config: Any) -> Any:
    """The attention spec of the model's single KV cache group (what this slice supports)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"the spot connector supports models with one KV cache group, got {len(groups)}"
        )
    return groups[0].kv_cache_spec


def layer_names(kv_cache_config: Any) -> list[str]:
    """Attention layers in a fixed order that every worker agrees on."""
    return sorted(kv_cache_config.kv_cache_groups[0].layer_names)


def kv_format_for(kv_cache_config: Any, model_fingerprint: str, device_type: str) -> KVFormat:
    """The KVFormat both connector roles derive from vLLM's KV cache config.

    The scheduler role never sees the tensors, so the format is built from the spec alone;
    the worker role checks the real tensors against it (``check_tensors``).
    """
    spec = attention_spec(kv_cache_config)
    dtype = str(spec.dtype).removeprefix("torch.")
    layout = (
        f"{device_type}:paged-blocks-first:kv_heads={spec.num_kv_heads},"
        f"block={spec.block_size},head_dim={spec.head_size},head_dim_v={spec.head_size_v}"
    )
    return KVFormat(
        model_fingerprint=model_fingerprint,
        dtype=dtype,
        layout=layout,
        layer_count=len(layer_names(kv_cache_config)),
        block_tokens=int(spec.block_size),
    )


def check_tensors(tensors: Sequence[torch.Tensor], num_blocks: int, kv_format: KVFormat) -> None:
    """Raise ValueError unless every layer tensor is blocks-first with ``num_blocks`` blocks."""
    if len(tensors) != kv_format.layer_count:
        raise ValueError(f"{len(tensors)} KV tensors for {kv_format.layer_count} layers")
    for tensor in tensors:
        if tensor.shape[0] != num_blocks or not tensor.is_contiguous():
            raise ValueError(
                f"KV tensor of shape {tuple(tensor.shape)} is not a contiguous blocks-first "
                f"cache of {num_blocks} blocks; this layout is not supported"
            )
        if str(tensor.dtype).removeprefix("torch.") != kv_format.dtype:
            raise ValueError(f"KV tensor dtype {tensor.dtype}, expected {kv_format.dtype}")


def copy_block(tensors: Sequence[torch.Tensor], block_id: int, header_bytes: int) -> torch.Tensor:
    """A private copy of one block, all layers, as flat bytes that follow ``header_bytes`` free
    bytes: the one buffer the store's codec seals in place and the socket sends from, so the
    KV is copied once (the cache slot may be reused as soon as the step ends, so the copy is
    taken now and sealed later, on the writer thread)."""
    sources = [tensor[block_id].reshape(-1).view(torch.uint8) for tensor in tensors]
    buffer = torch.empty(header_bytes + sum(s.numel() for s in sources), dtype=torch.uint8)
    offset = header_bytes
    for source in sources:
        buffer[offset : offset + source.numel()].copy_(source)
        offset += source.numel()
    return buffer


def block_buffer(copy: torch.Tensor) -> memoryview:
    """The bytes of a ``copy_block`` buffer as a writable view (no copy)."""
    return copy.numpy().data.cast("B")


def load_block(tensors: Sequence[torch.Tensor], block_id: int, payload: Buffer) -> None:
    """Write a stored block's payload into cache slot ``block_id`` of every layer, straight
    from the buffer Redis filled (a read-only view: numpy reads it without a copy, where
    torch would want a writable one)."""
    source = np.frombuffer(payload, dtype=np.uint8)
    targets = [tensor[block_id].view(-1).view(torch.uint8) for tensor in tensors]
    if sum(target.numel() for target in targets) != source.size:
        raise ValueError(
            f"a {source.size}-byte payload does not fill a block of "
            f"{sum(target.numel() for target in targets)} bytes"
        )
    offset = 0
    for target in targets:
        chunk = source[offset : offset + target.numel()]
        if target.device.type == "cpu":
            target.numpy()[:] = chunk
        else:
            target.copy_(torch.from_numpy(chunk.copy()))
        offset += target.numel()
