"""A store that may evict request records is refused at start, by the store and by the
processes that write records; one that evicts nothing is taken."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotinfer.local.worker_process import REPO_ROOT, process_environment
from store import RedisStore
from store.errors import EvictingStore
from tests.support.redis_server import RedisServer

LIMIT = ("--maxmemory", "64mb")


@pytest.fixture
def evicting() -> Iterator[RedisServer]:
    with RedisServer(extra_args=(*LIMIT, "--maxmemory-policy", "volatile-lru")) as server:
        yield server


def test_noeviction_is_taken(redis_server: RedisServer) -> None:
    store = RedisStore.from_url(redis_server.url)
    store.check_eviction_policy()
    store.close()


@pytest.mark.parametrize("policy", ["volatile-lru", "allkeys-lru", "volatile-ttl"])
def test_an_evicting_policy_with_a_memory_limit_is_refused(policy: str) -> None:
    with RedisServer(extra_args=(*LIMIT, "--maxmemory-policy", policy)) as server:
        store = RedisStore.from_url(server.url)
        with pytest.raises(EvictingStore, match=f"maxmemory-policy {policy} with maxmemory"):
            store.check_eviction_policy()
        store.close()


def test_an_evicting_policy_without_a_limit_is_only_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with RedisServer(extra_args=("--maxmemory-policy", "allkeys-lru")) as server:
        store = RedisStore.from_url(server.url)
        with caplog.at_level(logging.WARNING):
            store.check_eviction_policy()
        store.close()
    assert "allkeys-lru but no maxmemory" in caplog.text


@pytest.mark.parametrize("process", ["worker", "coordinator"])
def test_a_process_refuses_to_start_on_an_evicting_store(
    process: str, evicting: RedisServer, tiny_model: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", process, "--model", str(tiny_model), "--redis-url", evicting.url],
        cwd=REPO_ROOT,
        env=process_environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "maxmemory-policy volatile-lru" in done.stderr + done.stdout
    assert "would evict request records" in done.stderr + done.stdout
