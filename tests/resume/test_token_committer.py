"""The token committer against a real redis-server: every token lands once and in order,
ownership moves on resume, and a Redis that vanished and came back empty is refilled."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import pytest

from store import (
    RedisStore,
    RequestNotFound,
    RequestRecord,
    RequestStatus,
    StoreConfig,
)
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until_async
from worker.token_committer import TokenCommitter

RETRY_SECONDS = 0.1
WAIT_SECONDS = 30.0


def record(request_id: str, owner: str = "worker-x") -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        model_fingerprint="fp-test",
        prompt_token_ids=(1, 2, 3),
        sampling_params={"max_tokens": 100, "temperature": 0.0},
        kv_block_tokens=128,
        status=RequestStatus.RUNNING,
        owner_worker_id=owner,
    )


def committed(store: RedisStore, request_id: str) -> list[int] | None:
    try:
        return store.committed_tokens(request_id)
    except RequestNotFound:
        return None


@pytest.fixture
def store(own_redis_server: RedisServer) -> Iterator[RedisStore]:
    # Finished requests stay readable, so the tests can look at them.
    store = RedisStore.from_url(own_redis_server.url, config=StoreConfig(retention_seconds=600))
    yield store
    store.close()


async def test_tokens_of_many_requests_land_in_order(store: RedisStore) -> None:
    committer = TokenCommitter(store, "worker-x", RETRY_SECONDS)
    committer.start()
    expected: dict[str, list[int]] = {f"many-{i}": [] for i in range(8)}
    for request_id in expected:
        committer.admit(record(request_id))
    steps = 30
    for step in range(steps):
        for i, (request_id, tokens) in enumerate(expected.items()):
            new = [step * 10 + i, step]
            tokens.extend(new)
            committer.add(request_id, new)
        await asyncio.sleep(0)  # one engine step per loop turn, as vLLM delivers them
    for request_id in expected:
        committer.finish(request_id, RequestStatus.FINISHED)
    await committer.close(WAIT_SECONDS)
    for request_id, tokens in expected.items():
        assert store.committed_tokens(request_id) == tokens
        assert store.get_request(request_id).status == RequestStatus.FINISHED
    assert not committer.degraded
    # Batched: at most one round trip per engine step for all eight requests, not one each.
    assert committer.commit_calls <= steps


async def test_resumed_request_moves_to_the_new_owner(store: RedisStore) -> None:
    store.create_request(record("moved", owner="worker-a"))
    store.commit("moved", 0, [7, 8, 9])
    committer = TokenCommitter(store, "worker-b", RETRY_SECONDS)
    committer.start()
    committer.admit(store.get_request("moved"), [7, 8, 9])
    committer.add("moved", [10, 11])
    await wait_until_async(
        lambda: committed(store, "moved") == [7, 8, 9, 10, 11], "tokens after resume", WAIT_SECONDS
    )
    assert store.get_request("moved").owner_worker_id == "worker-b"
    await committer.close(WAIT_SECONDS)


async def test_redis_back_empty_gets_record_and_every_token_again(
    own_redis_server: RedisServer, store: RedisStore
) -> None:
    committer = TokenCommitter(store, "worker-x", RETRY_SECONDS)
    committer.start()
    committer.admit(dataclasses.replace(record("outage"), tenant="t-1"))
    committer.add("outage", [1, 2, 3])
    await wait_until_async(
        lambda: committed(store, "outage") == [1, 2, 3], "first commit", WAIT_SECONDS
    )

    await asyncio.to_thread(own_redis_server.kill)
    committer.add("outage", [4, 5])
    await wait_until_async(lambda: committer.degraded, "degraded while Redis is down", WAIT_SECONDS)
    committer.add("outage", [6])
    await asyncio.to_thread(own_redis_server.restart)

    await wait_until_async(lambda: not committer.degraded, "recovery", WAIT_SECONDS)
    await wait_until_async(
        lambda: committed(store, "outage") == [1, 2, 3, 4, 5, 6], "every token again", WAIT_SECONDS
    )
    refilled = store.get_request("outage")
    assert refilled.owner_worker_id == "worker-x"
    assert refilled.tenant == "t-1", "the refilled record keeps its tenant"
    committer.finish("outage", RequestStatus.FINISHED)
    await committer.close(WAIT_SECONDS)
    assert store.get_request("outage").status == RequestStatus.FINISHED


async def test_an_idle_committer_says_when_its_redis_stops_answering(
    own_redis_server: RedisServer, store: RedisStore
) -> None:
    # Nothing to write: only the committer's own ping can find out (and the coordinator then
    # gives this worker no request it could not persist).
    committer = TokenCommitter(store, "worker-x", RETRY_SECONDS)
    committer.start()
    await asyncio.sleep(RETRY_SECONDS * 3)
    assert not committer.degraded
    await asyncio.to_thread(own_redis_server.kill)
    await wait_until_async(lambda: committer.degraded, "degraded while idle", WAIT_SECONDS)
    await asyncio.to_thread(own_redis_server.restart)
    await wait_until_async(lambda: not committer.degraded, "back once it answers", WAIT_SECONDS)
    await committer.close(WAIT_SECONDS)
