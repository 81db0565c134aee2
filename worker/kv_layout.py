"""What the installed vLLM says about its KV cache, turned into a copier (kv_copy.py) and the
layout string a stored value carries.

vLLM 0.32 resolves one ``KVCacheLayout`` for the whole model in the engine core (from the
backends' ``supported_kv_cache_layouts``) and records it on ``KVCacheConfig.kv_cache_layout``;
the worker's cache is one ``[B, H, N, C]`` view per layer, strided as that layout says. The
connector takes the layout from there, never from the tensor's shape, and copies through the
views, so every layout vLLM defines is read and written the same way (kv_copy.py).

The layout string of a stored value names everything a reader must share with the writer
before the bytes mean the same thing::

    kv2:backend=CPU_ATTN,layout=LBHNC,block=128,dtype=bfloat16,tp=0/1,pp=0/1,
        heads=3,content=256,isa=vec,form=block-major,tail=kt-v

(one line; ``isa`` only on CPU, where the kernel's ISA decides the block interior). A reader
whose string differs rejects the value (the store compares it) and recomputes; it never
misreads another backend's, layout's, rank's or dtype's bytes.

The tail rule (kv_copy.py) is ``kt-v`` on vLLM-CPU's vector kernels (tests/worker/
test_kv_layout.py checks it against the real cache-write kernel), ``tokens`` on other
platforms' plain attention caches (C is K then V of one token), ``whole`` elsewhere.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from store import KVFormat
from store.block_codec import Buffer
from worker.kv_copy import BlockShape, CacheLayout, KVCopier

TOKEN_COLUMN_ISAS = frozenset({"vec", "vec16"})
"""vLLM-CPU kernels that keep, per head, K transposed then V (the ``kt-v`` tail)."""
STORED_FORM = "block-major"


class UnsupportedKVCache(ValueError):
    """The model's KV cache is one the spot connector cannot persist (named in the message)."""


def attention_spec(kv_cache_config: Any) -> Any:
    """The attention spec of the model's single KV cache group; several groups (sliding
    window beside full attention, hybrid models) are refused with their names."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        described = "; ".join(
            f"group {index}: {type(group.kv_cache_spec).__name__} "
            f"({len(group.layer_names)} layers, e.g. {sorted(group.layer_names)[:1]})"
            for index, group in enumerate(groups)
        )
        raise UnsupportedKVCache(
            f"the spot connector persists models with one KV cache group; this model has "
            f"{len(groups)}: {described}. Run it without --redis-url (no KV persistence)."
        )
    return groups[0].kv_cache_spec


def layer_names(kv_cache_config: Any) -> list[str]:
    """Attention layers in a fixed order that every worker agrees on."""
    return sorted(kv_cache_config.kv_cache_groups[0].layer_names)


@dataclass(frozen=True)
class ParallelPlace:
    """Which shard of the KV cache this process holds."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"rank outside its group: {self}")

    @property
    def sharded(self) -> bool:
        return self.tp_size > 1 or self.pp_size > 1


def parallel_place(vllm_config: Any, with_ranks: bool) -> ParallelPlace:
    """The group sizes from the config; the ranks from torch.distributed's groups when
    ``with_ranks`` (the worker role, where they exist), else 0."""
    parallel = vllm_config.parallel_config
    tp_size = int(parallel.tensor_parallel_size)
    pp_size = int(parallel.pipeline_parallel_size)
    tp_rank = pp_rank = 0
    if with_ranks and (tp_size > 1 or pp_size > 1):
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp_rank, pp_rank = int(get_tp_group().rank_in_group), int(get_pp_group().rank_in_group)
    return ParallelPlace(tp_rank, tp_size, pp_rank, pp_size)


def cache_layout(kv_cache_config: Any, vllm_config: Any) -> CacheLayout:
    """The layout vLLM resolved for this model, as data (vLLM's own enum member)."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if name is None:
        name = vllm_config.cache_config.kv_cache_layout
    if name is None:
        raise UnsupportedKVCache("vLLM has not resolved a KV cache layout for this model")
    member = KVCacheLayout[str(name)]
    return CacheLayout(member.name, tuple(member.stride_order))


def attention_backend_name(vllm_config: Any, spec: Any) -> str:
    """The attention backend vLLM's selector picks for this cache (both connector roles ask
    it the same way, so their layout strings agree)."""
    try:
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.selector import get_attn_backend
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        with set_current_vllm_config(vllm_config):
            backend = get_attn_backend(
                int(spec.head_size),
                spec.dtype,
                vllm_config.cache_config.cache_dtype,
                use_mla=isinstance(spec, MLAAttentionSpec),
                has_sliding_window=getattr(spec, "sliding_window", None) is not None,
            )
        return str(backend.get_name())
    except Exception:  # a selector of another shape: the string says so, both roles alike
        return "unknown"


def cpu_attention_isa(spec: Any) -> str:
    """The ISA vLLM-CPU's attention picks for this cache (its own choice, asked the same way)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(spec.dtype, int(spec.block_size), int(spec.head_size)))
    except Exception:  # another vLLM: tails stay whole blocks
        return ""


def _plain_attention(spec: Any) -> bool:
    """A cache whose N axis is tokens and C is K then V of one token."""
    return (
        getattr(spec, "num_head_slots", None) is None
        and getattr(spec, "state_content_bytes", None) is None
        and getattr(spec, "tokens_per_state", 1) == 1
        and getattr(spec, "page_size_padded", None) is None
        and spec.head_size == spec.head_size_v
    )


def copier_for(
    kv_cache_config: Any,
    vllm_config: Any,
    device_type: str,
    place: ParallelPlace,
    backend: str | None = None,
) -> KVCopier:
    """The copier of this model's cache, with the layout string its values carry."""
    spec = attention_spec(kv_cache_config)
    layout = cache_layout(kv_cache_config, vllm_config)
    element_bytes = torch.empty((), dtype=spec.dtype).element_size()
    shape = BlockShape(
        heads=int(spec.num_heads),
        block_tokens=int(spec.block_size),
        content_bytes=int(spec.state_content_size_bytes),
        element_bytes=element_bytes,
        head_dim=int(spec.head_size),
    )
    backend = backend or attention_backend_name(vllm_config, spec)
    isa = cpu_attention_isa(spec) if device_type == "cpu" else ""
    if not _plain_attention(spec):
        tail = "whole"
    elif device_type == "cpu":
        tail = "kt-v" if isa in TOKEN_COLUMN_ISAS and layout.is_block_contiguous else "whole"
    else:
        tail = "tokens"
    return KVCopier(
        layout=layout,
        shape=shape,
        num_layers=len(layer_names(kv_cache_config)),
        tail_rule=tail,
        descriptor=layout_string(backend, layout, shape, str(spec.dtype), place, tail, isa),
    )


def layout_string(
    backend: str,
    layout: CacheLayout,
    shape: BlockShape,
    dtype: str,
    place: ParallelPlace,
    tail: str,
    isa: str = "",
) -> str:
    """The layout string of a stored value (module docstring)."""
    parts = [
        f"backend={backend}",
        f"layout={layout.name}",
        f"block={shape.block_tokens}",
        f"dtype={dtype.removeprefix('torch.')}",
        f"tp={place.tp_rank}/{place.tp_size}",
        f"pp={place.pp_rank}/{place.pp_size}",
        f"heads={shape.heads}",
        f"content={shape.content_bytes}",
    ]
    if isa:
        parts.append(f"isa={isa}")
    parts += [f"form={STORED_FORM}", f"tail={tail}"]
    return "kv2:" + ",".join(parts)


def kv_format_for(
    kv_cache_config: Any, model_fingerprint: str, copier: KVCopier, chunk_tokens: int = 0
) -> KVFormat:
    """The KVFormat both connector roles derive from vLLM's config: the scheduler role never
    sees the tensors, the worker role checks them against it (``check_tensors``). The store's
    unit (its ``block_tokens``) is a chunk of ``chunk_tokens`` tokens (0: one engine block),
    a multiple of the engine's block size; any other size is refused."""
    spec = attention_spec(kv_cache_config)
    block_tokens = copier.shape.block_tokens
    chunk_tokens = chunk_tokens or block_tokens
    if chunk_tokens % block_tokens:
        raise UnsupportedKVCache(
            f"a KV chunk of {chunk_tokens} tokens is not a multiple of vLLM's block size "
            f"({block_tokens} tokens); set kv_chunk_tokens to a multiple of it"
        )
    return KVFormat(
        model_fingerprint=model_fingerprint,
        dtype=str(spec.dtype).removeprefix("torch."),
        layout=copier.descriptor,
        layer_count=copier.num_layers,
        block_tokens=chunk_tokens,
    )


def check_tensors(tensors: Sequence[torch.Tensor], num_blocks: int, copier: KVCopier) -> None:
    """Raise UnsupportedKVCache unless every layer is a ``[B, H, N, C]`` view of
    ``num_blocks`` blocks of the copier's shape (whatever its strides)."""
    if len(tensors) != copier.num_layers:
        raise UnsupportedKVCache(f"{len(tensors)} KV tensors for {copier.num_layers} layers")
    shape = copier.shape
    for tensor in tensors:
        content = tensor.shape[-1] * tensor.element_size() if tensor.dim() == 4 else -1
        logical = (tensor.shape[0], tensor.shape[1], tensor.shape[2], content)
        if tensor.dim() != 4 or logical != (
            num_blocks,
            shape.heads,
            shape.block_tokens,
            shape.content_bytes,
        ):
            raise UnsupportedKVCache(
                f"KV tensor of shape {tuple(tensor.shape)} ({tensor.dtype}) is not a "
                f"[{num_blocks}, {shape.heads}, {shape.block_tokens}, "
                f"{shape.content_bytes} bytes] view of the {copier.layout.name} cache"
            )
        if tensor.stride(-1) != 1:
            raise UnsupportedKVCache(f"KV tensor strides {tensor.stride()}: content not dense")


def host_tensor(payload: Buffer) -> torch.Tensor:
    """A stored payload as a flat uint8 tensor without a copy. The buffer may be read-only
    (what Redis filled, a mapped staging file): it is only ever read."""
    array = np.frombuffer(payload, dtype=np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": it is never written
        return torch.from_numpy(array)


def block_buffer(copy: torch.Tensor) -> memoryview:
    """The bytes of a ``KVCopier.gather`` buffer as a writable view (no copy)."""
    return copy.numpy().data.cast("B")
