"""The memory planner: how many sequences of a given context fit beside a model's weights.

Pure arithmetic on a Hugging Face `config.json` (Llama-family keys); it imports no torch, so
the CLI can answer at once and the worker can size vLLM before the engine starts.

The budget on one device (one tensor-parallel rank)::

    memory_bytes
    ├── reserve_bytes    10% of (weights + KV): activations, allocator slack, bursts
    └── usable = memory_bytes / 1.1
        ├── weight_bytes     parameters × bytes per parameter / tensor_parallel_size
        └── kv_budget_bytes  the rest, cut into blocks of block_tokens tokens
            ├── block 0  ─┐ block_bytes = block_tokens × kv_bytes_per_token
            ├── block 1   │ a sequence of L tokens holds ceil(L / block_tokens) blocks
            └── ...      ─┘

The 10% margin is kept on top of weights *and* KV cache: a server sized so that peak
concurrency exactly fills memory dies of OOM on the first burst of long prompts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_FILE_NAME = "config.json"

# Activation safety margin, as a fraction of weights + KV cache.
ACTIVATION_RESERVE_FRACTION_NUM = 1
ACTIVATION_RESERVE_FRACTION_DEN = 10

# Bits per stored element. Bits rather than bytes keep int4 (half a byte) in integer math.
DTYPE_BITS: Mapping[str, int] = {
    "float32": 32,
    "fp32": 32,
    "float": 32,
    "bfloat16": 16,
    "bf16": 16,
    "float16": 16,
    "fp16": 16,
    "half": 16,
    "fp8": 8,
    "fp8_e4m3": 8,
    "fp8_e5m2": 8,
}
QUANTIZATION_BITS: Mapping[str, int] = {"fp8": 8, "int8": 8, "int4": 4}
AUTO_DTYPE = "auto"
# Used when dtype is "auto" and config.json names none: what HF checkpoints default to.
FALLBACK_DTYPE = "float32"

GPU_BLOCK_TOKENS = 16
CPU_BLOCK_TOKENS = 128
STANDARD_CONTEXT_TOKENS: tuple[int, ...] = (512, 2048, 4096, 8192, 32768)


class MemoryPlanError(ValueError):
    """The model cannot be served in the given memory (or the inputs make no sense)."""


@dataclass(frozen=True)
class ModelShape:
    """The parts of a decoder-only transformer's config that decide its memory footprint."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    """Key/value heads (grouped-query attention); equal to num_attention_heads without GQA."""
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    """True when the output projection reuses the input embedding matrix (no lm_head)."""
    max_position_embeddings: int
    attention_bias: bool = False
    mlp_bias: bool = False
    config_dtype: str | None = None
    """The dtype named by config.json (`torch_dtype` or `dtype`), if any."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise MemoryPlanError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_kv_heads != 0:
            raise MemoryPlanError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """Reads Llama-family keys; head_dim defaults to hidden_size / num_attention_heads."""

        def required(key: str) -> Any:
            if key not in config:
                raise MemoryPlanError(f"config.json has no {key!r}")
            return config[key]

        hidden_size = required("hidden_size")
        num_attention_heads = required("num_attention_heads")
        head_dim = config.get("head_dim")
        if head_dim is None:
            if not isinstance(hidden_size, int) or not isinstance(num_attention_heads, int):
                raise MemoryPlanError("hidden_size and num_attention_heads must be integers")
            head_dim = hidden_size // num_attention_heads
        num_kv_heads = config.get("num_key_value_heads")
        dtype = config.get("torch_dtype") or config.get("dtype")
        return cls(
            vocab_size=required("vocab_size"),
            hidden_size=hidden_size,
            num_layers=required("num_hidden_layers"),
            num_attention_heads=num_attention_heads,
            num_kv_heads=num_attention_heads if num_kv_heads is None else num_kv_heads,
            head_dim=head_dim,
            intermediate_size=required("intermediate_size"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=required("max_position_embeddings"),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            config_dtype=str(dtype) if dtype is not None else None,
        )

    def parameter_count(self) -> int:
        """Parameters of a Llama-style decoder: embeddings, layers, final norm, lm_head."""
        hidden = self.hidden_size
        q_width = self.num_attention_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        attention = hidden * q_width + 2 * hidden * kv_width + q_width * hidden
        if self.attention_bias:
            attention += q_width + 2 * kv_width + hidden
        mlp = 3 * hidden * self.intermediate_size
        if self.mlp_bias:
            mlp += 2 * self.intermediate_size + hidden
        norms = 2 * hidden
        per_layer = attention + mlp + norms
        embeddings = self.vocab_size * hidden
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * hidden
        return embeddings + self.num_layers * per_layer + hidden + lm_head


def load_model_config(source: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """A config as a dict: given as one, or read from a config.json or a model folder."""
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / CONFIG_FILE_NAME
    if not path.is_file():
        raise MemoryPlanError(f"no model config at {path}")
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MemoryPlanError(f"cannot read {path}: {exc}") from exc
    if not isinstance(loaded, dict):
        raise MemoryPlanError(f"{path} does not hold a JSON object")
    return loaded


def dtype_bits(dtype: str) -> int:
    """Bits per element for a dtype name such as 'bf16' or 'float32'."""
    try:
        return DTYPE_BITS[dtype.lower()]
    except KeyError:
        known = ", ".join(sorted(DTYPE_BITS))
        raise MemoryPlanError(f"unknown dtype {dtype!r} (known: {known})") from None


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads one rank stores.

    Heads are split across ranks; when there are more ranks than KV heads each rank keeps a
    replica of one head (vLLM does the same), so a rank never holds fewer than one.
    """
    return max(1, num_kv_heads // tensor_parallel_size)


@dataclass(frozen=True)
class MemoryPlan:
    """How one device's memory splits between weights, KV cache and the reserve.

    All byte counts are per tensor-parallel rank.
    """

    parameter_count: int
    weight_bytes: int
    kv_bytes_per_token: int
    memory_bytes: int
    reserve_bytes: int
    kv_budget_bytes: int
    block_tokens: int
    block_bytes: int
    num_kv_blocks: int
    context_tokens: int
    max_concurrent_seqs: int
    """Sequences of context_tokens tokens (prompt + output) that fit at once."""
    weight_dtype: str
    kv_dtype: str
    tensor_parallel_size: int
    max_position_embeddings: int
    concurrency_by_context: tuple[tuple[int, int], ...] = field(default=())
    """(context_tokens, max_concurrent_seqs) for the standard context lengths that fit the
    model's max_position_embeddings."""

    def max_concurrent_seqs_for(self, context_tokens: int) -> int:
        """Sequences of this many tokens whose KV blocks fit in the budget at once."""
        if context_tokens <= 0:
            raise MemoryPlanError(f"context must be positive, got {context_tokens}")
        blocks_per_seq = math.ceil(context_tokens / self.block_tokens)
        return self.num_kv_blocks // blocks_per_seq

    @property
    def kv_cache_bytes(self) -> int:
        """The KV budget rounded down to whole blocks: what to hand the engine."""
        return self.num_kv_blocks * self.block_bytes

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view (the `spotinfer plan --json` output)."""
        return {
            "parameter_count": self.parameter_count,
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "memory_bytes": self.memory_bytes,
            "reserve_bytes": self.reserve_bytes,
            "kv_budget_bytes": self.kv_budget_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "block_tokens": self.block_tokens,
            "block_bytes": self.block_bytes,
            "num_kv_blocks": self.num_kv_blocks,
            "context_tokens": self.context_tokens,
            "max_concurrent_seqs": self.max_concurrent_seqs,
            "weight_dtype": self.weight_dtype,
            "kv_dtype": self.kv_dtype,
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_position_embeddings": self.max_position_embeddings,
            "max_concurrent_seqs_by_context": {
                str(context): seqs for context, seqs in self.concurrency_by_context
            },
        }


def _resolve_dtype(dtype: str, shape: ModelShape) -> str:
    if dtype.lower() != AUTO_DTYPE:
        dtype_bits(dtype)
        return dtype.lower()
    named = shape.config_dtype or FALLBACK_DTYPE
    dtype_bits(named)
    return named.lower()


def _check_plan_inputs(
    shape: ModelShape, memory_bytes: int, context_tokens: int, block_tokens: int, tp: int
) -> None:
    """Raises MemoryPlanError for sizes that are not positive or heads that do not split."""
    if memory_bytes <= 0:
        raise MemoryPlanError(f"memory must be positive, got {memory_bytes} bytes")
    if context_tokens <= 0:
        raise MemoryPlanError(f"context must be positive, got {context_tokens} tokens")
    if block_tokens <= 0:
        raise MemoryPlanError(f"block size must be positive, got {block_tokens} tokens")
    if tp <= 0:
        raise MemoryPlanError(f"tensor parallel size must be positive, got {tp}")
    if shape.num_attention_heads % tp != 0:
        raise MemoryPlanError(
            f"{shape.num_attention_heads} attention heads do not split over {tp} ranks"
        )
    if shape.num_kv_heads % tp != 0 and tp % shape.num_kv_heads != 0:
        raise MemoryPlanError(f"{shape.num_kv_heads} KV heads do not split over {tp} ranks")


def _weight_bits(weight_dtype: str, quantization: str | None) -> int:
    """Bits per weight: the dtype's, or the quantization's when there is one."""
    if quantization is None:
        return dtype_bits(weight_dtype)
    try:
        return QUANTIZATION_BITS[quantization.lower()]
    except KeyError:
        known = ", ".join(sorted(QUANTIZATION_BITS))
        raise MemoryPlanError(f"unknown quantization {quantization!r} (known: {known})") from None


def _reserve_and_kv_budget(memory_bytes: int, weight_bytes: int) -> tuple[int, int]:
    """The activation reserve and what is left for the KV cache; raises MemoryPlanError
    when the weights leave nothing."""
    # weights + KV + reserve <= memory, reserve = 10% of (weights + KV).
    usable_bytes = (
        memory_bytes
        * ACTIVATION_RESERVE_FRACTION_DEN
        // (ACTIVATION_RESERVE_FRACTION_DEN + ACTIVATION_RESERVE_FRACTION_NUM)
    )
    reserve_bytes = memory_bytes - usable_bytes
    kv_budget_bytes = usable_bytes - weight_bytes
    if kv_budget_bytes <= 0:
        raise MemoryPlanError(
            f"the weights alone ({weight_bytes / 2**30:.2f} GiB per rank) leave no room for a "
            f"KV cache in {memory_bytes / 2**30:.2f} GiB with a 10% reserve; "
            "use more memory, more tensor parallelism or quantization"
        )
    return reserve_bytes, kv_budget_bytes


def plan_memory(
    config: Mapping[str, Any] | str | Path,
    memory_bytes: int,
    context_tokens: int,
    *,
    dtype: str = "bf16",
    quantization: str | None = None,
    kv_dtype: str | None = None,
    tensor_parallel_size: int = 1,
    block_tokens: int = GPU_BLOCK_TOKENS,
    standard_contexts: Sequence[int] = STANDARD_CONTEXT_TOKENS,
) -> MemoryPlan:
    """Plans one rank's memory.

    dtype: the weights' and activations' dtype ("auto" takes config.json's).
    quantization: "fp8", "int8" or "int4" weights; the KV cache keeps kv_dtype.
    kv_dtype: the KV cache's dtype; defaults to dtype.
    memory_bytes: memory of one device; weights are divided evenly over tensor_parallel_size.

    Raises MemoryPlanError (a ValueError) for nonsense inputs and when the weights alone
    leave nothing for the KV cache.
    """
    shape = ModelShape.from_config(load_model_config(config))
    tp = tensor_parallel_size
    _check_plan_inputs(shape, memory_bytes, context_tokens, block_tokens, tp)
    weight_dtype = _resolve_dtype(dtype, shape)
    weight_bits = _weight_bits(weight_dtype, quantization)
    cache_dtype = weight_dtype if kv_dtype is None else _resolve_dtype(kv_dtype, shape)

    parameter_count = shape.parameter_count()
    weight_bytes = math.ceil(parameter_count * weight_bits / (8 * tp))
    kv_bytes_per_token = (
        2
        * shape.num_layers
        * kv_heads_per_rank(shape.num_kv_heads, tp)
        * shape.head_dim
        * dtype_bits(cache_dtype)
        // 8
    )
    reserve_bytes, kv_budget_bytes = _reserve_and_kv_budget(memory_bytes, weight_bytes)
    block_bytes = block_tokens * kv_bytes_per_token
    num_kv_blocks = kv_budget_bytes // block_bytes

    def seqs_at(context: int) -> int:
        return num_kv_blocks // math.ceil(context / block_tokens)

    return MemoryPlan(
        parameter_count=parameter_count,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_bytes_per_token,
        memory_bytes=memory_bytes,
        reserve_bytes=reserve_bytes,
        kv_budget_bytes=kv_budget_bytes,
        block_tokens=block_tokens,
        block_bytes=block_bytes,
        num_kv_blocks=num_kv_blocks,
        context_tokens=context_tokens,
        max_concurrent_seqs=seqs_at(context_tokens),
        weight_dtype=weight_dtype if quantization is None else quantization.lower(),
        kv_dtype=cache_dtype,
        tensor_parallel_size=tp,
        max_position_embeddings=shape.max_position_embeddings,
        concurrency_by_context=tuple(
            (context, seqs_at(context))
            for context in standard_contexts
            if context <= shape.max_position_embeddings
        ),
    )


def plan_for_worker(
    config: Mapping[str, Any] | str | Path,
    memory_bytes: int,
    max_model_len: int,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    block_tokens: int = CPU_BLOCK_TOKENS,
) -> tuple[int, int]:
    """(kv_cache_bytes, max_num_seqs) for a worker that must fit its peak concurrency.

    kv_cache_bytes is the block-aligned KV budget of one rank; max_num_seqs is how many
    sequences of max_model_len tokens fit in it at once. Raises MemoryPlanError when not
    even one such sequence fits.
    """
    plan = plan_memory(
        config,
        memory_bytes,
        max_model_len,
        dtype=dtype,
        tensor_parallel_size=tensor_parallel_size,
        block_tokens=block_tokens,
        standard_contexts=(),
    )
    if plan.max_concurrent_seqs < 1:
        raise MemoryPlanError(
            f"not one sequence of {max_model_len} tokens fits: the KV budget is "
            f"{plan.kv_budget_bytes / 2**20:.1f} MiB, one sequence needs "
            f"{math.ceil(max_model_len / block_tokens) * plan.block_bytes / 2**20:.1f} MiB"
        )
    return plan.kv_cache_bytes, plan.max_concurrent_seqs
