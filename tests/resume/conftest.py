"""Real processes for the resume tests: one redis-server and worker processes on the tiny
model (float32, see DESIGN.md: fidelity checks need it) that persist to it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from spotinfer.local.worker_process import WorkerProcess
from tests.support.redis_server import RedisServer
from worker.constants import DEFAULT_KV_CHUNK_TOKENS

MAX_MODEL_LEN = 1024
# The store's unit: one stored value is a chunk of this many tokens (the worker's default
# kv_chunk_tokens, two of vLLM-CPU's 128-token blocks); block hashes, persisted "blocks" and
# loaded tokens count in it.
BLOCK_TOKENS = DEFAULT_KV_CHUNK_TOKENS


def worker_flags(redis_url: str) -> tuple[str, ...]:
    return (
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--memory-gib",
        "0.25",
        "--redis-url",
        redis_url,
        "--kv-persist-policy",
        "eager",
    )


@pytest.fixture(scope="package")
def standby(
    tiny_model: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """Worker B: resumes what other workers left behind."""
    with WorkerProcess(
        tiny_model,
        *worker_flags(redis_server.url),
        "--worker-id",
        "worker-b",
        log_dir=tmp_path_factory.mktemp("standby-logs"),
        metrics=True,
    ) as process:
        yield process
