"""Redis going away and coming back: typed, prompt failures, then normal service again."""

from __future__ import annotations

import pytest

from store import (
    RedisStore,
    RequestRecord,
    StoreConfig,
    StoreUnavailable,
    TokenCommit,
)
from tests.support.redis_server import RedisCluster, RedisServer

FAST_FAIL = StoreConfig(socket_timeout_seconds=0.5, socket_connect_timeout_seconds=0.5)


def record(request_id: str) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        model_fingerprint="m",
        prompt_token_ids=(1, 2, 3),
        sampling_params={},
        kv_block_tokens=16,
    )


@pytest.mark.timeout(60)
def test_killed_redis_raises_store_unavailable_then_recovers_after_restart(
    own_redis_server: RedisServer,
) -> None:
    store = RedisStore.from_url(own_redis_server.url, config=FAST_FAIL)
    store.create_request(record("r-1"))
    store.commit("r-1", 0, [4])
    own_redis_server.kill()
    assert not store.is_available()
    with pytest.raises(StoreUnavailable):
        store.commit_step([TokenCommit("r-1", 1, (5,))])
    with pytest.raises(StoreUnavailable):
        store.get_request("r-1")
    own_redis_server.restart()
    # the restarted server is empty and has forgotten the Lua scripts: both must work
    store.ping()
    store.create_request(record("r-2"))
    assert store.commit("r-2", 0, [9, 8]) == 2
    assert store.committed_tokens("r-2") == [9, 8]
    store.close()


@pytest.mark.timeout(90)
def test_cluster_node_loss_raises_store_unavailable() -> None:
    with RedisCluster() as cluster:
        store = RedisStore.from_url(cluster.url, cluster=True, config=FAST_FAIL)
        request_ids = [f"c-{i}" for i in range(12)]
        for request_id in request_ids:
            store.create_request(record(request_id))
        cluster.servers[1].kill()
        with pytest.raises(StoreUnavailable):
            # a dozen requests cover every master; the step must fail loudly, not hang
            store.commit_step([TokenCommit(rid, 0, (1,)) for rid in request_ids])
        store.close()


def test_connecting_to_a_dead_cluster_is_store_unavailable() -> None:
    with RedisServer() as server:
        dead_url = server.url
    with pytest.raises(StoreUnavailable):
        RedisStore.from_url(dead_url, cluster=True, config=FAST_FAIL)
