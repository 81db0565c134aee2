"""Real Redis for the context daemon tests: one standalone server and one 3-master cluster.

The store fixtures are parametrized over both, so every store test runs unchanged on Redis
Cluster. The standalone server is the suite's `redis_server` (tests/conftest.py); both live
as long as these tests run, and tests keep apart by unique request ids.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from store import RedisStore, StoreConfig
from tests.support.redis_server import RedisCluster, RedisServer

TEST_STORE_CONFIG = StoreConfig(
    request_ttl_seconds=600,
    retention_seconds=0,
    block_ttl_seconds=300,
    socket_timeout_seconds=2.0,
    socket_connect_timeout_seconds=1.0,
)


@pytest.fixture(scope="package")
def redis_cluster() -> Iterator[RedisCluster]:
    with RedisCluster() as cluster:
        yield cluster


@pytest.fixture(scope="package", params=["single", "cluster"])
def redis_client(request: pytest.FixtureRequest) -> Iterator[redis.Redis | redis.RedisCluster]:
    """A bytes-returning client of the standalone server or of the cluster."""
    client: redis.Redis | redis.RedisCluster
    if request.param == "single":
        server: RedisServer = request.getfixturevalue("redis_server")
        client = redis.Redis.from_url(server.url, socket_timeout=5)
    else:
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        client = redis.RedisCluster.from_url(cluster.url, socket_timeout=5)
    yield client
    client.close()


@pytest.fixture
def store(redis_client: redis.Redis | redis.RedisCluster) -> RedisStore:
    return RedisStore(redis_client, TEST_STORE_CONFIG)
