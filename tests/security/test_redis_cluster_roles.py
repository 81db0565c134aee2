"""A Redis Cluster locked down as the local cluster runs it (redis_cluster_process.py): every
master speaks TLS only, its bus too, and knows the same ACL users and MAC keyring. A process
given its role's flags (one node and --redis-cluster) reaches every master as its own user;
given the same node without --redis-cluster it would not."""

from __future__ import annotations

import argparse
import asyncio
import uuid
from collections.abc import Iterator

import pytest
import redis
from redis.crc import key_slot
from redis.exceptions import NoPermissionError

from common.config_source import ConfigSource
from coordinator.route_records import RouteRecord, RouteRecords
from spotinfer.local.redis_cluster_process import (
    RedisClusterProcess,
    cluster_info,
    slot_ranges,
)
from spotinfer.local.redis_process import RedisProcess, answers_ping
from store import (
    BlockWrite,
    KVBlock,
    KVFormat,
    RedisStore,
    RequestRecord,
    StoreConfig,
    StoreError,
    block_reads,
    keys,
)
from store.acl import Role
from tests.support.redis_server import skip_without_redis

MASTERS = 3
FORMAT = KVFormat("tiny:cluster", "float32", "cpu:test", layer_count=2, block_tokens=4)
PAYLOAD = bytes(range(256)) * 8


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterProcess]:
    skip_without_redis()
    with RedisClusterProcess(MASTERS, secure=True) as cluster:
        yield cluster


def _config(flags: list[str]) -> StoreConfig:
    """The StoreConfig a process builds from these flags (its own flag parser)."""
    source = ConfigSource(StoreConfig, "store")
    parser = argparse.ArgumentParser()
    source.add_arguments(parser)
    return source.resolve(parser.parse_args(flags), environ={}).config


def _persist(store: RedisStore) -> tuple[str, list[int]]:
    """A record, two committed tokens, two full blocks and a tail, as a worker writes them."""
    request_id = f"rc-{uuid.uuid4().hex[:12]}"
    tokens = list(range(10))
    store.create_request(RequestRecord(request_id, FORMAT.model_fingerprint, tuple(tokens), {}, 4))
    store.commit(request_id, 0, [1, 2])
    writes = [
        BlockWrite(
            request_id,
            read.block_index,
            KVBlock(FORMAT, read.prefix_hash, read.num_tokens, PAYLOAD),
        )
        for read in block_reads(request_id, FORMAT, tokens)
    ]
    assert all(store.put_blocks(writes))
    return request_id, tokens


def _as_role(cluster: RedisClusterProcess, node: RedisProcess, role: Role) -> redis.Redis:
    """A plain client of one master as ``role``'s ACL user."""
    assert cluster.security is not None
    return redis.Redis.from_url(
        node.url,
        username=role.value,
        password=cluster.security.password(role.value),
        ssl_ca_certs=str(cluster.security.ca_file),
        socket_timeout=5,
    )


def _master_of(key: str) -> int:
    """The index of the master that holds ``key``'s slot."""
    slot = key_slot(key.encode())
    return next(i for i, (first, last) in enumerate(slot_ranges(MASTERS)) if first <= slot <= last)


def _keys_per_master(cluster: RedisClusterProcess) -> list[int]:
    counts = []
    for node in cluster.nodes:
        client = cluster.node_client(node)
        counts.append(sum(1 for _ in client.scan_iter(match=keys.schema_pattern())))
        client.close()
    return counts


def test_every_master_is_up_over_tls_with_its_share_of_the_slots(
    redis_cluster: RedisClusterProcess,
) -> None:
    assert slot_ranges(MASTERS) == [(0, 5460), (5461, 10921), (10922, 16383)]
    for node in redis_cluster.nodes:
        client = redis_cluster.node_client(node)
        info = cluster_info(client)
        assert info["cluster_state"] == "ok" and int(info["cluster_known_nodes"]) == MASTERS
        assert client.config_get("tls-cluster") == {"tls-cluster": "yes"}  # the bus too
        client.close()
        assert not answers_ping(node.port), "no plaintext"
    flags = redis_cluster.store_flags(Role.WORKER)
    assert flags[flags.index("--redis-url") + 1] == redis_cluster.url
    assert "--redis-cluster" in flags and "--redis-username" in flags


def test_a_worker_from_its_flags_writes_to_every_master_as_its_own_user(
    redis_cluster: RedisClusterProcess,
) -> None:
    config = _config(redis_cluster.store_flags(Role.WORKER))
    assert config.cluster and config.username == Role.WORKER.value and config.mac_key_file
    before = _keys_per_master(redis_cluster)
    worker = RedisStore.from_config(config)
    try:
        written = [_persist(worker) for _ in range(12)]
        for request_id, tokens in written:
            loaded = worker.get_blocks(block_reads(request_id, FORMAT, tokens), FORMAT)
            assert [type(block) for block in loaded] == [KVBlock] * 3  # MAC verified
            assert worker.committed_tokens(request_id) == [1, 2]
    finally:
        worker.close()
    grown = [
        after - was for after, was in zip(_keys_per_master(redis_cluster), before, strict=True)
    ]
    assert all(grown), f"keys on every master: {grown}"
    for node in redis_cluster.nodes:  # the same users everywhere, the worker's still narrow
        as_worker = _as_role(redis_cluster, node, Role.WORKER)
        with pytest.raises(NoPermissionError):
            as_worker.execute_command("FLUSHALL")
        as_worker.close()


def test_without_redis_cluster_the_same_node_refuses_the_other_masters_keys(
    redis_cluster: RedisClusterProcess,
) -> None:
    flags = [flag for flag in redis_cluster.store_flags(Role.WORKER) if flag != "--redis-cluster"]
    ids = (f"rc-plain-{i}" for i in range(1000))
    request_id = next(rid for rid in ids if _master_of(keys.request_meta_key(rid)) != 0)
    plain = RedisStore.from_config(_config(flags))
    try:
        owner = redis_cluster.nodes[_master_of(keys.request_meta_key(request_id))]
        with pytest.raises(StoreError, match=f"127.0.0.1:{owner.port}"):  # MOVED there
            plain.create_request(RequestRecord(request_id, "fp", (1, 2), {}, 4))
    finally:
        plain.close()


def test_the_coordinator_keeps_route_records_on_every_master(
    redis_cluster: RedisClusterProcess,
) -> None:
    config = _config(redis_cluster.store_flags(Role.COORDINATOR))
    routes = [
        RouteRecord(
            f"rc-route-{uuid.uuid4().hex[:8]}", "c-1", "w-1", "running", "NONE", 3, "INTERACTIVE", 1
        )
        for _ in range(12)
    ]

    async def keep_and_read() -> list[RouteRecord | None]:
        records = RouteRecords.from_url(config.url, 60, 5, 0.05, config)
        for route in routes:
            records.note(route)
        await records.flush()
        found = [await records.get(route.request_id) for route in routes]
        await records.stop()
        return found

    assert asyncio.run(keep_and_read()) == routes
    assert len({_master_of(keys.request_route_key(r.request_id)) for r in routes}) > 1


def test_a_restart_brings_every_master_back_empty_and_clients_go_on(
    redis_cluster: RedisClusterProcess,
) -> None:
    worker = RedisStore.from_config(_config(redis_cluster.store_flags(Role.WORKER)))
    try:
        _persist(worker)
        redis_cluster.restart()
        assert _keys_per_master(redis_cluster) == [0] * MASTERS
        _persist(worker)  # the same client, on the new cluster (same ports)
    finally:
        worker.close()
