"""Gathering KV blocks out of a paged cache into one host buffer, and scattering them back.

This module knows torch and nothing else (no vLLM, no store), so that the same code runs in
the connector, in tests/gpu on CUDA tensors and in benchmarks/gpu_kv_copy.py on a machine with
only PyTorch. The layout comes in as data: vLLM's ``KVCacheLayout`` (RFC #42082) describes
every cache by one logical shape and a stride permutation::

    logical  [L, B, H, N, C]     layers, blocks, head slots, states (tokens), content bytes
    LBHNC    L > B > H > N > C   per layer, blocks first (vLLM-CPU, FlashInfer HND)
    LBNHC    L > B > N > H > C   per layer, tokens before heads (FlashAttention NHD)
    LHBNC    L > H > B > N > C   per layer, heads outermost
    BLHNC    B > L > H > N > C   cross-layer: one block holds every layer
    BLNHC    B > L > N > H > C   cross-layer, tokens before heads
    BHLNC    B > H > L > N > C   cross-layer, heads outermost

vLLM hands the connector one ``[B, H, N, C]`` view per layer, strided as the layout says.
Whatever the strides, ``view[b]`` is block ``b`` of that layer in logical order, so one copy
path serves every layout: it reads the blocks through the views and writes them to the host
in one stored form, whose bytes depend on the layout only through the views::

    value (one save or load) = block 0 | block 1 | ... | block k-1
    block                    = layer 0 [H, N, C] | layer 1 [H, N, C] | ...   (logical order)

A partial last block (a pause's tail, n < N tokens filled) keeps only its filled tokens where
the tail rule allows it:

- ``tokens``: N is the token axis (the GPU backends: C is K then V of one token), so the
  tail is ``[H, :n, C]`` of each layer, in any layout;
- ``kt-v``: vLLM-CPU's vector kernels ignore N inside a block and keep, per head,
  K^T [head_dim x N] then V [N x head_dim]; the tail is K^T[:, :n] | V[:n] of each head
  (only where each head's block is one contiguous run: block-contiguous layouts);
- ``whole``: nothing is known of the interior (AMX tiles, packed or quantised caches): a
  tail is a whole block like any other.

Copies to and from a CUDA cache gather on the device first (one index_select per layer, one
stack) and cross the bus once per save or load, into a pinned buffer when asked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

TAIL_RULES = ("tokens", "kt-v", "whole")
_DIM_L, _DIM_B, _DIM_H, _DIM_N, _DIM_C = range(5)


@dataclass(frozen=True)
class CacheLayout:
    """One physical KV layout: its name and its stride permutation of ``[L, B, H, N, C]``
    (outermost first), as vLLM's ``KVCacheLayout`` member of that name has it."""

    name: str
    stride_order: tuple[int, ...]

    def __post_init__(self) -> None:
        if sorted(self.stride_order) != list(range(5)):
            raise ValueError(f"{self.name}: {self.stride_order} is not a permutation of 5 axes")
        if self.stride_order[-1] != _DIM_C:
            raise ValueError(f"{self.name}: content must be the innermost axis")

    @property
    def is_block_contiguous(self) -> bool:
        """Each block's ``[H, N, C]`` is one run of bytes inside a layer."""
        return self.stride_order[-3:] == (_DIM_H, _DIM_N, _DIM_C)

    @property
    def is_block_outermost(self) -> bool:
        return self.stride_order[0] == _DIM_B


VLLM_LAYOUTS: tuple[CacheLayout, ...] = (
    CacheLayout("LBHNC", (0, 1, 2, 3, 4)),
    CacheLayout("LBNHC", (0, 1, 3, 2, 4)),
    CacheLayout("LHBNC", (0, 2, 1, 3, 4)),
    CacheLayout("BLHNC", (1, 0, 2, 3, 4)),
    CacheLayout("BLNHC", (1, 0, 3, 2, 4)),
    CacheLayout("BHLNC", (1, 2, 0, 3, 4)),
)
"""The layouts vLLM 0.32 defines (tests/worker/test_kv_copy_layouts.py checks them against the
installed enum); used where vLLM is absent (tests/gpu, benchmarks/gpu_kv_copy.py)."""


@dataclass(frozen=True)
class BlockShape:
    """One layer's block: ``heads`` x ``block_tokens`` x ``content_bytes``; ``head_dim`` and
    ``element_bytes`` matter to the ``kt-v`` tail only."""

    heads: int
    block_tokens: int
    content_bytes: int
    element_bytes: int = 1
    head_dim: int = 0

    @property
    def block_bytes(self) -> int:
        return self.heads * self.block_tokens * self.content_bytes


def layer_views(
    raw: torch.Tensor, layout: CacheLayout, num_layers: int, num_blocks: int, shape: BlockShape
) -> list[torch.Tensor]:
    """Per-layer ``[B, H, N, C]`` uint8 views of one dense buffer laid out as ``layout``:
    the strides of vLLM's ``compute_layout_strides`` for an unpadded cache (checked against
    it in tests/worker/test_kv_copy_layouts.py)."""
    logical = (num_layers, num_blocks, shape.heads, shape.block_tokens, shape.content_bytes)
    if raw.dtype != torch.uint8 or raw.numel() < math.prod(logical):
        raise ValueError(f"need {math.prod(logical)} uint8 bytes, got {raw.numel()} {raw.dtype}")
    strides = [0] * 5
    current = 1
    for dim in reversed(layout.stride_order):
        strides[dim] = current
        current *= logical[dim]
    full = torch.as_strided(raw, logical, strides, raw.storage_offset())
    return [full[layer] for layer in range(num_layers)]


def as_bytes(views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The views as uint8 ``[B, H, N, C bytes]`` (the content axis must have stride 1)."""
    return [view if view.dtype == torch.uint8 else view.view(torch.uint8) for view in views]


class LayoutMismatch(ValueError):
    """A stored value was written under another layout string than the reader's."""


@dataclass(frozen=True)
class KVCopier:
    """Gathers and scatters runs of blocks of one cache in the stored form (module docstring).
    ``descriptor``: the layout string a value carries; a value of another string is refused."""

    layout: CacheLayout
    shape: BlockShape
    num_layers: int
    tail_rule: str
    descriptor: str

    def __post_init__(self) -> None:
        if self.tail_rule not in TAIL_RULES:
            raise ValueError(f"tail rule {self.tail_rule!r}, expected one of {TAIL_RULES}")
        if self.tail_rule == "kt-v" and not self._kt_v_valid():
            raise ValueError(
                f"a kt-v tail needs a block-contiguous layout and 2*head_dim*element_bytes "
                f"== content_bytes; {self.layout.name} with {self.shape} has neither"
            )

    def _kt_v_valid(self) -> bool:
        shape = self.shape
        return (
            self.layout.is_block_contiguous
            and shape.head_dim > 0
            and 2 * shape.head_dim * shape.element_bytes == shape.content_bytes
        )

    def trims(self, num_tokens: int) -> bool:
        """A last block of ``num_tokens`` tokens is stored as its filled tokens only."""
        return self.tail_rule != "whole" and 0 < num_tokens < self.shape.block_tokens

    def tail_layer_bytes(self, num_tokens: int) -> int:
        return self.shape.heads * num_tokens * self.shape.content_bytes

    def value_bytes(self, num_blocks: int, last_tokens: int = 0) -> int:
        """Bytes of a value of ``num_blocks`` blocks whose last holds ``last_tokens`` (0:
        full)."""
        if num_blocks <= 0:
            raise ValueError("a value holds at least one block")
        last = self.shape.block_bytes
        if self.trims(last_tokens):
            last = self.tail_layer_bytes(last_tokens)
        return self.num_layers * ((num_blocks - 1) * self.shape.block_bytes + last)

    def last_block_tokens(self, num_tokens: int) -> tuple[int, int]:
        """How many blocks a run of ``num_tokens`` tokens fills, and the tokens of its last
        block (0: full), the form ``gather`` and ``scatter`` take."""
        block = self.shape.block_tokens
        blocks = -(-num_tokens // block)
        last = num_tokens - (blocks - 1) * block
        return blocks, 0 if last == block else last

    def part(
        self, value: torch.Tensor, num_blocks: int, last_tokens: int, first: int, count: int
    ) -> tuple[torch.Tensor, int]:
        """Blocks ``[first, first + count)`` of a value of ``num_blocks`` blocks (no copy):
        the slice and the tokens of its last block, as ``scatter`` takes them."""
        if not 0 <= first < first + count <= num_blocks:
            raise ValueError(f"blocks [{first}, {first + count}) of a {num_blocks}-block value")
        whole = self.num_layers * self.shape.block_bytes
        end = value.numel() if first + count == num_blocks else (first + count) * whole
        return value[first * whole : end], last_tokens if first + count == num_blocks else 0

    def gather(
        self,
        views: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        last_tokens: int = 0,
        header_bytes: int = 0,
        pin_memory: bool = False,
        out: torch.Tensor | None = None,
        sync: bool = True,
    ) -> torch.Tensor:
        """A private host copy of blocks ``block_ids`` (in order), all layers, as one flat
        uint8 buffer after ``header_bytes`` free bytes; the last block holds ``last_tokens``
        tokens (0: full). ``out``: the buffer to fill (a slot of the daemon's ring), exactly
        ``header_bytes + value_bytes(...)`` long. From a CUDA cache into a pinned buffer the
        copy is asynchronous on the current stream; ``sync=False`` returns without waiting
        for it (kv_transfer.CopyStream records an event instead)."""
        views = self._checked(views, block_ids)
        size = self.value_bytes(len(block_ids), last_tokens)
        if out is None:
            out = torch.empty(header_bytes + size, dtype=torch.uint8, pin_memory=pin_memory)
        elif out.dtype != torch.uint8 or out.numel() != header_bytes + size:
            raise ValueError(
                f"gather into a {out.numel()}-element {out.dtype} buffer: "
                f"{header_bytes + size} uint8 needed"
            )
        trimmed = self.trims(last_tokens)
        full_ids = list(block_ids[:-1]) if trimmed else list(block_ids)
        full_bytes = len(full_ids) * self.num_layers * self.shape.block_bytes
        if full_ids:
            region = out[header_bytes : header_bytes + full_bytes]
            self._gather_full(views, full_ids, region.view(len(full_ids), self.num_layers, -1))
        if trimmed:
            tail = out[header_bytes + full_bytes :].view(self.num_layers, -1)
            parts = [self._tail_of(view[block_ids[-1]], last_tokens) for view in views]
            _copy_into(tail, torch.stack(parts))
        device = views[0].device
        if sync and device.type == "cuda" and out.is_pinned():
            torch.cuda.current_stream(device).synchronize()
        return out

    def _gather_full(
        self, views: list[torch.Tensor], block_ids: list[int], region: torch.Tensor
    ) -> None:
        device = views[0].device
        index = _index(block_ids, device)
        if device.type == "cpu":
            for layer, view in enumerate(views):
                source, target = _widened(view, region[:, layer])
                target.copy_(source.index_select(0, index).reshape(len(block_ids), -1))
            return
        gathered = torch.stack(
            [view.index_select(0, index).reshape(len(block_ids), -1) for view in views], dim=1
        )
        region.copy_(gathered, non_blocking=region.is_pinned())

    def scatter(
        self,
        views: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        value: torch.Tensor,
        last_tokens: int = 0,
        descriptor: str | None = None,
    ) -> None:
        """Write a gathered value (flat uint8, host) into blocks ``block_ids`` of every
        layer. ``descriptor``: the layout string the value was stored with; refused
        (LayoutMismatch) unless it is this copier's."""
        if descriptor is not None and descriptor != self.descriptor:
            raise LayoutMismatch(
                f"a value stored as {descriptor!r} cannot be loaded into {self.descriptor!r}"
            )
        views = self._checked(views, block_ids)
        expected = self.value_bytes(len(block_ids), last_tokens)
        if value.numel() != expected:
            raise ValueError(
                f"a {value.numel()}-byte value is not {len(block_ids)} block(s) ending with "
                f"{last_tokens or self.shape.block_tokens} tokens ({expected} bytes)"
            )
        device = views[0].device
        source = value.to(device, non_blocking=True) if device.type != "cpu" else value
        trimmed = self.trims(last_tokens)
        full_ids = list(block_ids[:-1]) if trimmed else list(block_ids)
        full_bytes = len(full_ids) * self.num_layers * self.shape.block_bytes
        if full_ids:
            region = source[:full_bytes].view(len(full_ids), self.num_layers, -1)
            index = _index(full_ids, device)
            block = (self.shape.heads, self.shape.block_tokens, self.shape.content_bytes)
            for layer, view in enumerate(views):
                target, part = view, region[:, layer].reshape(len(full_ids), *block)
                if device.type == "cpu":
                    target, part = _widened(target, part)
                target.index_copy_(0, index, part)
        if trimmed:
            tail = source[full_bytes:].view(self.num_layers, -1)
            for layer, view in enumerate(views):
                self._fill_tail(view[block_ids[-1]], tail[layer], last_tokens)

    def _checked(
        self, views: Sequence[torch.Tensor], block_ids: Sequence[int]
    ) -> list[torch.Tensor]:
        if not block_ids:
            raise ValueError("no blocks to copy")
        views = as_bytes(views)
        if len(views) != self.num_layers:
            raise ValueError(f"{len(views)} layer views for {self.num_layers} layers")
        block = (self.shape.heads, self.shape.block_tokens, self.shape.content_bytes)
        for view in views:
            if tuple(view.shape[1:]) != block:
                raise ValueError(
                    f"a layer view of shape {tuple(view.shape)} is not [B, {block[0]}, "
                    f"{block[1]}, {block[2]} bytes]"
                )
        return views

    def _tail_of(self, block: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The filled tokens of one layer's block ``[H, N, C]`` as one flat tensor."""
        if self.tail_rule == "tokens":
            return block[:, :num_tokens].reshape(-1)
        keys, values = self._kt_v_parts(block, num_tokens)
        heads = self.shape.heads
        return torch.cat([keys.reshape(heads, -1), values.reshape(heads, -1)], dim=1).reshape(-1)

    def _fill_tail(self, block: torch.Tensor, stored: torch.Tensor, num_tokens: int) -> None:
        heads, content = self.shape.heads, self.shape.content_bytes
        if self.tail_rule == "tokens":
            block[:, :num_tokens].copy_(stored.view(heads, num_tokens, content))
            return
        dim_bytes = self.shape.head_dim * self.shape.element_bytes
        per_head = stored.view(heads, 2, num_tokens * dim_bytes)
        keys, values = self._kt_v_parts(block, num_tokens)
        keys.copy_(per_head[:, 0].reshape(keys.shape))
        values.copy_(per_head[:, 1].reshape(values.shape))

    def _kt_v_parts(
        self, block: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first ``num_tokens`` token columns of a CPU vector-kernel block:
        per head K^T[:, :n] (``[H, head_dim, n, element]``) and V[:n] (``[H, n, head_dim *
        element]``)."""
        shape = self.shape
        heads, tokens = shape.heads, shape.block_tokens
        per_head = block.reshape(heads, 2, tokens * shape.head_dim * shape.element_bytes)
        keys = per_head[:, 0].view(heads, shape.head_dim, tokens, shape.element_bytes)
        values = per_head[:, 1].view(heads, tokens, shape.head_dim * shape.element_bytes)
        return keys[:, :, :num_tokens], values[:, :num_tokens]


def _index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """Block ids as a long tensor on ``device``, to a CUDA device without waiting: a plain
    ``torch.tensor(..., device=)`` synchronises the current stream, which on a side stream
    means waiting for the forward pass it follows, and pinning a fresh buffer per copy may
    wait for the whole device; an asynchronous copy from pageable memory is staged by the
    driver and returns."""
    index = torch.tensor(block_ids, dtype=torch.long)
    if device.type == "cpu":
        return index
    return index.to(device, non_blocking=True)


_WIDE_DTYPES = (torch.int64, torch.int32, torch.int16)


def _widened(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same uint8 bytes seen as the widest integer type all of ``tensors`` allow (their
    last axis, offsets and strides divisible by its size), else as they are. The CPU's
    strided copy kernels move one element per step: a uint8 ``index_copy_`` ran at ~0.9 GB/s
    where the same bytes as int64 ran at ~6 GB/s (one core)."""
    for dtype in _WIDE_DTYPES:
        try:
            return tuple(tensor.view(dtype) for tensor in tensors)
        except RuntimeError:
            continue
    return tensors


def _copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copy a device tensor into a host region of the same number of bytes (without waiting
    where the region is pinned: the caller synchronises)."""
    target.copy_(source.reshape(target.shape), non_blocking=target.is_pinned())
