"""Starts vLLM on a model with an explicit KV cache size; prints the blocks it allocated.

Run as a script (vLLM may spawn processes, so the work sits under the __main__ guard):
    python vllm_kv_probe.py MODEL_DIR KV_CACHE_BYTES MAX_MODEL_LEN
Prints one JSON line: {"num_kv_blocks": ..., "block_tokens": ...}.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm import LLM

    model_dir, kv_cache_bytes, max_model_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_bytes,
    )
    cache_config = llm.llm_engine.vllm_config.cache_config
    print(
        json.dumps(
            {"num_kv_blocks": cache_config.num_gpu_blocks, "block_tokens": cache_config.block_size}
        )
    )


if __name__ == "__main__":
    main()
