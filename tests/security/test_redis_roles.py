"""Redis locked down as the local cluster runs it (TLS only, one ACL user per role, a MAC
keyring), against a real redis-server: each role does its own work and nothing else, and
what a writer of Redis without the key plants is refused."""

from __future__ import annotations

import asyncio
import struct
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import NoPermissionError

from coordinator.route_records import RouteRecord, RouteRecords
from spotinfer.local.certs import make_ca
from spotinfer.local.redis_process import RedisProcess
from spotinfer.local.redis_security import ADMIN_USER, RedisSecurity
from store import (
    BlockRejected,
    BlockWrite,
    KVBlock,
    KVFormat,
    RecordRejected,
    RedisStore,
    RejectReason,
    RequestRecord,
    StoreError,
    StoreUnavailable,
    block_reads,
    keys,
)
from store.acl import Role
from store.errors import RequestNotFound
from tests.support.redis_server import skip_without_redis

FORMAT = KVFormat("tiny:acl", "float32", "cpu:test", layer_count=2, block_tokens=4)
PAYLOAD = bytes(range(256)) * 8


def _security(server: RedisProcess) -> RedisSecurity:
    assert server.security is not None
    return server.security


def _client(server: RedisProcess, user: str) -> redis.Redis:
    security = _security(server)
    return redis.Redis.from_url(
        server.url,
        username=user,
        password=security.password(user),
        ssl_ca_certs=str(security.ca_file),
        socket_timeout=5,
    )


@pytest.fixture
def stores(secure_redis: RedisProcess) -> Iterator[dict[Role, RedisStore]]:
    security = _security(secure_redis)
    opened = {
        role: RedisStore.from_config(security.store_config(secure_redis.url, role)) for role in Role
    }
    yield opened
    for store in opened.values():
        store.close()


def _persisted(store: RedisStore, tenant: str = "") -> tuple[str, list[int]]:
    """A record and its two full blocks and tail, written as a worker writes them."""
    request_id = f"acl-{uuid.uuid4().hex[:12]}"
    tokens = list(range(10))
    store.create_request(
        RequestRecord(request_id, FORMAT.model_fingerprint, tuple(tokens), {}, 4, tenant=tenant)
    )
    writes = [
        BlockWrite(
            request_id,
            read.block_index,
            KVBlock(FORMAT, read.prefix_hash, read.num_tokens, PAYLOAD),
        )
        for read in block_reads(request_id, FORMAT, tokens, tenant=tenant)
    ]
    assert all(store.put_blocks(writes))
    return request_id, tokens


def test_the_worker_user_persists_and_loads_but_reaches_nothing_else(
    secure_redis: RedisProcess, stores: dict[Role, RedisStore]
) -> None:
    worker = stores[Role.WORKER]
    request_id, tokens = _persisted(worker)
    loaded = worker.get_blocks(block_reads(request_id, FORMAT, tokens), FORMAT)
    assert [type(block) for block in loaded] == [KVBlock] * 3
    assert worker.get_request(request_id).prompt_token_ids == tuple(tokens)

    admin = _client(secure_redis, ADMIN_USER)
    admin.hset(keys.request_route_key(request_id), "owner_worker_id", "w-1")
    as_worker = _client(secure_redis, Role.WORKER.value)
    for command in (
        ("HGETALL", keys.request_route_key(request_id)),
        ("HSET", keys.request_route_key(request_id), "owner_worker_id", "evil"),
        ("FLUSHALL",),
        ("CONFIG", "GET", "*"),
        ("CONFIG", "SET", "appendonly", "yes"),
        ("KEYS", "*"),
        ("ACL", "LIST"),
    ):
        with pytest.raises(NoPermissionError):
            as_worker.execute_command(*command)
    assert admin.hget(keys.request_route_key(request_id), "owner_worker_id") == b"w-1"
    assert admin.exists(keys.request_meta_key(request_id))  # no FLUSHALL went through


def test_the_coordinator_keeps_route_records_and_cannot_commit_tokens(
    secure_redis: RedisProcess, stores: dict[Role, RedisStore]
) -> None:
    request_id, _ = _persisted(stores[Role.WORKER])
    coordinator = stores[Role.COORDINATOR]
    assert coordinator.get_request(request_id).request_id == request_id  # adoption reads it
    # Its scripts may not append a token (no APPEND for its user, inside a script too).
    with pytest.raises(StoreError, match="NOPERM|no permissions|can't run this command"):
        coordinator.commit(request_id, 0, [1])
    # A restarted coordinator replays a finished request's tokens, then releases its keys.
    worker = stores[Role.WORKER]
    assert coordinator.committed_tokens(request_id) == worker.committed_tokens(request_id)
    assert coordinator.release_request(request_id)
    security = _security(secure_redis)
    route = RouteRecord(request_id, "c-1", "w-1", "running", "NONE", 3, "INTERACTIVE", 1)

    async def keep_and_read() -> RouteRecord | None:
        config = security.store_config(secure_redis.url, Role.COORDINATOR)
        records = RouteRecords.from_url(secure_redis.url, 60, 5, 0.05, config)
        records.note(route)
        await records.flush()
        found = await records.get(request_id)
        await records.stop()
        return found

    assert asyncio.run(keep_and_read()) == route
    with pytest.raises(NoPermissionError):
        _client(secure_redis, Role.COORDINATOR.value).execute_command("FLUSHALL")


def test_the_daemon_user_writes_requests_but_no_route(
    stores: dict[Role, RedisStore], secure_redis: RedisProcess
) -> None:
    """The daemon persists its worker's hand-over: request keys and KV blocks, as the
    worker's user may; the coordinators' route records and admin commands stay out of reach."""
    daemon = stores[Role.DAEMON]
    assert daemon.is_available()
    with pytest.raises(RequestNotFound):
        daemon.get_request("anything")  # allowed: there is just no such request
    with pytest.raises(NoPermissionError):
        _client(secure_redis, Role.DAEMON.value).execute_command("FLUSHALL")
    with pytest.raises(NoPermissionError):
        _client(secure_redis, Role.DAEMON.value).hgetall(keys.request_route_key("anything"))


def test_plaintext_and_a_foreign_ca_are_refused(secure_redis: RedisProcess, tmp_path: Path) -> None:
    security = _security(secure_redis)
    plain = RedisStore.from_url(secure_redis.url.replace("rediss://", "redis://"))
    assert not plain.is_available()
    foreign = RedisSecurity.create(tmp_path / "other")
    stranger = RedisStore.from_config(
        security.store_config(secure_redis.url, Role.WORKER, tls_ca_file=str(foreign.ca_file))
    )
    with pytest.raises(StoreUnavailable, match="certificate verify failed"):
        stranger.ping()


def test_a_server_of_the_cluster_ca_is_reached_with_that_ca_alone(tmp_path: Path) -> None:
    """The local cluster signs Redis's certificate with the CA of its gRPC TLS: clients
    verify Redis with that one CA, and a CA of the server's own would be refused."""
    skip_without_redis()
    cluster_ca = make_ca(tmp_path / "cluster")
    own = RedisSecurity.create(tmp_path / "own")
    with RedisProcess(secure=True, ca=cluster_ca) as server:
        security = _security(server)
        assert security.ca_file == cluster_ca.cert
        worker = RedisStore.from_config(security.store_config(server.url, Role.WORKER))
        stranger = RedisStore.from_config(
            security.store_config(server.url, Role.WORKER, tls_ca_file=str(own.ca_file))
        )
        try:
            worker.ping()
            with pytest.raises(StoreUnavailable, match="certificate verify failed"):
                stranger.ping()
        finally:
            worker.close()
            stranger.close()


def test_a_block_altered_with_its_crc_fixed_is_refused_by_its_mac(
    secure_redis: RedisProcess, stores: dict[Role, RedisStore]
) -> None:
    worker = stores[Role.WORKER]
    request_id, tokens = _persisted(worker)
    reads = block_reads(request_id, FORMAT, tokens)
    admin = _client(secure_redis, ADMIN_USER)
    stored = bytearray(admin.get(reads[1].key) or b"")
    stored[-7] ^= 0x01  # one payload byte
    struct.pack_into("<I", stored, 8, zlib.crc32(bytes(stored[12:])))  # and a matching CRC
    admin.set(reads[1].key, bytes(stored))
    first, second, tail = worker.get_blocks(reads, FORMAT)
    assert isinstance(first, KVBlock) and isinstance(tail, KVBlock)
    assert isinstance(second, BlockRejected) and second.reason is RejectReason.MAC


def test_an_altered_record_is_refused_by_its_mac(
    secure_redis: RedisProcess, stores: dict[Role, RedisStore]
) -> None:
    worker = stores[Role.WORKER]
    request_id, _ = _persisted(worker, tenant="a")
    admin = _client(secure_redis, ADMIN_USER)
    admin.hset(keys.request_meta_key(request_id), "tenant", "b")
    with pytest.raises(RecordRejected):
        worker.get_request(request_id)
    assert isinstance(RecordRejected(request_id), RequestNotFound)
    assert worker.request_views([request_id]) == {request_id: None}


def test_tenants_never_share_a_block(stores: dict[Role, RedisStore]) -> None:
    worker = stores[Role.WORKER]
    a_id, tokens = _persisted(worker, tenant="a")
    b_reads = block_reads(f"b-{uuid.uuid4().hex[:8]}", FORMAT, tokens, tenant="b")
    a_reads = block_reads(a_id, FORMAT, tokens, tenant="a")
    assert not {r.key for r in a_reads if r.is_full} & {r.key for r in b_reads if r.is_full}
    assert worker.blocks_present([r.prefix_hash for r in b_reads if r.is_full]) == [False] * 2


def test_every_role_can_read_the_eviction_policy_it_is_checked_against(
    stores: dict[Role, RedisStore], caplog: pytest.LogCaptureFixture
) -> None:
    """INFO memory is each role's: the start-time check (store/eviction.py) reads the policy
    as the process's own user, and is not left unable to tell."""
    for store in stores.values():
        store.check_eviction_policy()
    assert "could not check" not in caplog.text
