"""Fixtures shared by the whole suite: the tiny model, the test environment, and Redis."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotinfer.local.redis_process import RedisProcess
from store import RedisStore
from tests.support.redis_server import RedisServer, skip_without_redis

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The deterministic tiny Llama (fixed-seed weights, trained tokenizer), built once."""
    from spotinfer.models.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="package")
def redis_server() -> Iterator[RedisServer]:
    """The real redis-server of a test package (tests/coordinator, tests/resume, ...): one
    per package, because the package-scoped worker fixtures persist to it. Tests keep apart
    by their request ids. A test that kills or restarts Redis takes `own_redis_server`."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[RedisStore]:
    """A client of the package's redis-server (a package that needs another defines its own)."""
    store = RedisStore.from_url(redis_server.url)
    yield store
    store.close()


@pytest.fixture
def own_redis_server() -> Iterator[RedisServer]:
    """A redis-server of this test alone, which it may kill and restart."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="package")
def secure_redis() -> Iterator[RedisProcess]:
    """A locked-down redis-server (TLS only, one ACL user per role, a MAC keyring; see
    spotinfer/local/redis_security.py) on loopback; its ``security`` holds the files."""
    skip_without_redis()
    with RedisProcess(secure=True) as server:
        yield server
