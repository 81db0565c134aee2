"""The memory planner's arithmetic against known models and its own invariants."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from known_model_configs import (
    LLAMA_3_8B,
    LLAMA_3_8B_PARAMETERS,
    LLAMA_3_70B,
    LLAMA_3_70B_PARAMETERS,
    SMOLLM2_135M,
    SMOLLM2_135M_PARAMETERS,
)

from worker.memory_planner import (
    MemoryPlan,
    MemoryPlanError,
    plan_for_worker,
    plan_memory,
)

GIB = 2**30


def test_llama_3_8b_bf16_kv_is_128_kib_per_token() -> None:
    plan = plan_memory(LLAMA_3_8B, 80 * GIB, 8192, dtype="bf16")
    assert plan.kv_bytes_per_token == 131072


def test_llama_3_70b_bf16_kv_is_320_kib_per_token() -> None:
    plan = plan_memory(LLAMA_3_70B, 192 * GIB, 8192, dtype="bf16")
    assert plan.kv_bytes_per_token == 327680


@pytest.mark.parametrize(
    ("config", "parameters"),
    [
        (LLAMA_3_8B, LLAMA_3_8B_PARAMETERS),
        (LLAMA_3_70B, LLAMA_3_70B_PARAMETERS),
        (SMOLLM2_135M, SMOLLM2_135M_PARAMETERS),
    ],
)
def test_bf16_weight_bytes_match_the_published_parameter_count(
    config: dict, parameters: int
) -> None:
    plan = plan_memory(config, 1024 * GIB, 2048, dtype="bf16")
    assert plan.weight_bytes == pytest.approx(2 * parameters, rel=0.02)


def test_tied_embeddings_are_counted_once() -> None:
    untied = plan_memory({**SMOLLM2_135M, "tie_word_embeddings": False}, 4 * GIB, 2048)
    tied = plan_memory(SMOLLM2_135M, 4 * GIB, 2048)
    assert untied.parameter_count - tied.parameter_count == 49152 * 576


@pytest.mark.parametrize(
    ("dtype", "quantization", "bytes_per_parameter"),
    [
        ("fp32", None, 4),
        ("float32", None, 4),
        ("bf16", None, 2),
        ("fp16", None, 2),
        ("bf16", "fp8", 1),
        ("bf16", "int8", 1),
        ("bf16", "int4", 0.5),
    ],
)
def test_weight_bytes_follow_dtype_and_quantization(
    dtype: str, quantization: str | None, bytes_per_parameter: float
) -> None:
    plan = plan_memory(LLAMA_3_8B, 1024 * GIB, 2048, dtype=dtype, quantization=quantization)
    assert plan.weight_bytes == math.ceil(LLAMA_3_8B_PARAMETERS * bytes_per_parameter)


def test_quantized_weights_keep_the_kv_cache_dtype() -> None:
    plan = plan_memory(LLAMA_3_8B, 80 * GIB, 8192, dtype="bf16", quantization="int4")
    assert plan.kv_bytes_per_token == 131072
    assert plan_memory(LLAMA_3_8B, 80 * GIB, 8192, kv_dtype="fp8").kv_bytes_per_token == 65536


def test_auto_dtype_reads_the_config() -> None:
    assert plan_memory(LLAMA_3_8B, 80 * GIB, 8192, dtype="auto").weight_dtype == "bfloat16"


def test_tensor_parallelism_splits_weights_and_kv_heads() -> None:
    single = plan_memory(LLAMA_3_70B, 192 * GIB, 8192)
    tp4 = plan_memory(LLAMA_3_70B, 80 * GIB, 8192, tensor_parallel_size=4)
    assert tp4.weight_bytes == math.ceil(2 * LLAMA_3_70B_PARAMETERS / 4)
    assert tp4.kv_bytes_per_token == single.kv_bytes_per_token // 4
    # 16 ranks over 8 KV heads: each rank still holds one (replicated) head.
    tp16 = plan_memory(LLAMA_3_70B, 80 * GIB, 8192, tensor_parallel_size=16)
    assert tp16.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2


def test_heads_that_do_not_split_over_the_ranks_are_rejected() -> None:
    with pytest.raises(MemoryPlanError, match="do not split"):
        plan_memory(LLAMA_3_8B, 80 * GIB, 8192, tensor_parallel_size=3)


def test_the_reserve_is_ten_percent_of_weights_plus_kv() -> None:
    plan = plan_memory(LLAMA_3_8B, 80 * GIB, 8192)
    assert plan.weight_bytes + plan.kv_budget_bytes + plan.reserve_bytes == 80 * GIB
    assert plan.reserve_bytes == pytest.approx(
        0.1 * (plan.weight_bytes + plan.kv_budget_bytes), abs=2
    )


def test_llama_3_8b_on_an_80_gib_gpu() -> None:
    plan = plan_memory(LLAMA_3_8B, 80 * GIB, 8192, block_tokens=16)
    kv_budget = int(80 * GIB / 1.1) - 2 * LLAMA_3_8B_PARAMETERS
    assert plan.kv_budget_bytes == pytest.approx(kv_budget, abs=2)
    assert plan.block_bytes == 16 * 131072
    assert plan.num_kv_blocks == plan.kv_budget_bytes // (16 * 131072)
    # 8192 tokens take 512 blocks of 16, i.e. 1 GiB of KV cache per sequence.
    assert plan.max_concurrent_seqs == plan.kv_budget_bytes // GIB == 57
    assert dict(plan.concurrency_by_context) == {
        512: plan.num_kv_blocks // 32,
        2048: plan.num_kv_blocks // 128,
        4096: plan.num_kv_blocks // 256,
        8192: 57,
    }


def test_a_partial_block_still_takes_a_whole_block() -> None:
    plan = plan_memory(LLAMA_3_8B, 80 * GIB, 8192, block_tokens=16)
    assert plan.max_concurrent_seqs_for(17) == plan.num_kv_blocks // 2
    assert plan.max_concurrent_seqs_for(16) == plan.num_kv_blocks


def test_weights_that_do_not_fit_raise_a_clear_error() -> None:
    with pytest.raises(ValueError, match="weights alone"):
        plan_memory(LLAMA_3_70B, 80 * GIB, 8192, dtype="bf16")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "bf12"}, "unknown dtype"),
        ({"quantization": "int3"}, "unknown quantization"),
        ({"block_tokens": 0}, "block size"),
        ({"tensor_parallel_size": 0}, "tensor parallel"),
    ],
)
def test_nonsense_options_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(MemoryPlanError, match=message):
        plan_memory(LLAMA_3_8B, 80 * GIB, 8192, **kwargs)


def test_a_config_without_a_required_key_names_it() -> None:
    config = {key: value for key, value in LLAMA_3_8B.items() if key != "num_hidden_layers"}
    with pytest.raises(MemoryPlanError, match="num_hidden_layers"):
        plan_memory(config, 80 * GIB, 8192)


def test_config_is_read_from_a_file_or_a_model_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B))
    from_dict = plan_memory(LLAMA_3_8B, 80 * GIB, 8192)
    assert plan_memory(tmp_path, 80 * GIB, 8192) == from_dict
    assert plan_memory(tmp_path / "config.json", 80 * GIB, 8192) == from_dict
    with pytest.raises(MemoryPlanError, match="no model config"):
        plan_memory(tmp_path / "missing", 80 * GIB, 8192)


def test_the_plan_is_frozen() -> None:
    plan = plan_memory(LLAMA_3_8B, 80 * GIB, 8192)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.max_concurrent_seqs = 1000  # type: ignore[misc]


def test_plan_for_worker_sizes_whole_blocks_for_max_model_len() -> None:
    kv_cache_bytes, max_num_seqs = plan_for_worker(
        SMOLLM2_135M, 2 * GIB, max_model_len=4096, dtype="float32", block_tokens=128
    )
    block_bytes = 128 * 2 * 30 * 3 * 64 * 4
    assert kv_cache_bytes % block_bytes == 0
    assert max_num_seqs == kv_cache_bytes // block_bytes // 32
    assert max_num_seqs >= 1


def test_plan_for_worker_refuses_when_one_sequence_does_not_fit() -> None:
    with pytest.raises(MemoryPlanError, match="not one sequence"):
        plan_for_worker(SMOLLM2_135M, 2 * GIB // 5, max_model_len=8192, dtype="bf16")


@given(
    memory_gib=st.floats(min_value=20.0, max_value=2048.0),
    context_tokens=st.integers(min_value=1, max_value=131072),
    block_tokens=st.sampled_from([16, 32, 128]),
    tensor_parallel_size=st.sampled_from([1, 2, 4, 8]),
)
def test_peak_concurrency_always_fits_with_the_margin(
    memory_gib: float, context_tokens: int, block_tokens: int, tensor_parallel_size: int
) -> None:
    memory_bytes = int(memory_gib * GIB)
    plan: MemoryPlan = plan_memory(
        LLAMA_3_8B,
        memory_bytes,
        context_tokens,
        block_tokens=block_tokens,
        tensor_parallel_size=tensor_parallel_size,
    )
    blocks_per_seq = math.ceil(context_tokens / block_tokens)
    peak_kv_bytes = plan.max_concurrent_seqs * blocks_per_seq * plan.block_bytes
    assert 1.1 * (plan.weight_bytes + peak_kv_bytes) <= memory_bytes
    # ...and one more sequence would not fit in the budget.
    assert (plan.max_concurrent_seqs + 1) * blocks_per_seq * plan.block_bytes > (
        plan.kv_budget_bytes
    )
