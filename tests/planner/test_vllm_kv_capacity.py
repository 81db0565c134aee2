"""The planner's KV capacity for the tiny model against what vLLM really allocates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spotinfer.models.tiny import build_tiny_llama
from worker.memory_planner import CPU_BLOCK_TOKENS, plan_for_worker, plan_memory

PROBE = Path(__file__).with_name("vllm_kv_probe.py")
MAX_MODEL_LEN = 4096


@pytest.mark.integration
def test_planned_kv_blocks_match_vllm_within_five_percent(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    model_dir = build_tiny_llama(tmp_path / "tiny")
    memory_bytes = 64 * 2**20
    kv_cache_bytes, max_num_seqs = plan_for_worker(
        model_dir, memory_bytes, MAX_MODEL_LEN, dtype="float32", block_tokens=CPU_BLOCK_TOKENS
    )
    plan = plan_memory(
        model_dir, memory_bytes, MAX_MODEL_LEN, dtype="float32", block_tokens=CPU_BLOCK_TOKENS
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "TOKENIZERS_PARALLELISM": "false",
    }
    result = subprocess.run(
        [sys.executable, str(PROBE), str(model_dir), str(kv_cache_bytes), str(MAX_MODEL_LEN)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    allocated = json.loads(result.stdout.strip().splitlines()[-1])
    assert allocated["block_tokens"] == CPU_BLOCK_TOKENS
    assert allocated["num_kv_blocks"] == pytest.approx(plan.num_kv_blocks, rel=0.05)
    blocks_per_seq = MAX_MODEL_LEN // CPU_BLOCK_TOKENS
    assert allocated["num_kv_blocks"] // blocks_per_seq >= max_num_seqs
