"""The worker sizes its KV cache with the memory planner, and vLLM really allocates that."""

from __future__ import annotations

from pathlib import Path

from protos.spotinfer.v1 import worker_pb2
from spotinfer.local.worker_process import WorkerProcess
from worker.memory_planner import plan_memory

MEMORY_GIB = 0.25  # tests/worker/conftest.py
MAX_MODEL_LEN = 1024


def test_planned_kv_capacity_matches_what_vllm_allocated(
    worker: WorkerProcess, tiny_model: Path
) -> None:
    plan = plan_memory(
        tiny_model / "config.json",
        int(MEMORY_GIB * 2**30),
        MAX_MODEL_LEN,
        dtype="float32",
        block_tokens=128,
    )
    stats = worker.stub.Stats(worker_pb2.StatsRequest(), timeout=10)
    allocated_bytes = stats.kv_blocks_total * plan.block_bytes
    assert abs(allocated_bytes - plan.kv_cache_bytes) <= 0.05 * plan.kv_cache_bytes, (
        f"vLLM allocated {allocated_bytes} bytes of KV, the plan said {plan.kv_cache_bytes}"
    )
    # Peak concurrency fits: every admitted sequence at full length has its blocks.
    assert stats.max_num_seqs <= plan.max_concurrent_seqs
    blocks_per_seq = -(-MAX_MODEL_LEN // stats.kv_block_tokens)
    assert stats.max_num_seqs * blocks_per_seq <= stats.kv_blocks_total
