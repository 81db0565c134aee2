"""The RequestStore contract, run on both implementations: MemoryStore (what the unit tests
give the coordinator and the token committer) and RedisStore on a real Redis. Whatever one
does here, the other must do too."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

from spotinfer.local.redis_process import RedisProcess
from store import (
    ConflictReason,
    InvalidTransition,
    MemoryStore,
    RedisStore,
    RequestExists,
    RequestNotFound,
    RequestRecord,
    RequestStatus,
    RequestStore,
    TokenCommit,
)
from store.acl import Role
from tests.context_daemon.conftest import TEST_STORE_CONFIG
from tests.support.redis_server import RedisServer

StoreMaker = Callable[[int], RequestStore]  # retention seconds -> a store


@pytest.fixture(params=["memory", "redis", "redis-tls-worker-acl"])
def make_store(request: pytest.FixtureRequest) -> Iterator[StoreMaker]:
    if request.param == "memory":
        yield lambda retention: MemoryStore(
            dataclasses.replace(TEST_STORE_CONFIG, retention_seconds=retention)
        )
        return
    if request.param == "redis-tls-worker-acl":  # as a worker logs in: TLS, its ACL user
        secure: RedisProcess = request.getfixturevalue("secure_redis")
        assert secure.security is not None
        stores: list[RedisStore] = []

        def worker_store(retention: int) -> RequestStore:
            config = secure.security.store_config(  # type: ignore[union-attr]
                secure.url, Role.WORKER, retention_seconds=retention
            )
            stores.append(RedisStore.from_config(config))
            return stores[-1]

        yield worker_store
        for store in stores:
            store.close()
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    client = redis.Redis.from_url(server.url, socket_timeout=5)
    yield lambda retention: RedisStore(
        client, dataclasses.replace(TEST_STORE_CONFIG, retention_seconds=retention)
    )
    client.close()


def _record() -> RequestRecord:
    return RequestRecord(
        request_id=f"contract-{uuid.uuid4().hex[:12]}",
        model_fingerprint="tiny:contract",
        prompt_token_ids=(1, 2, 3),
        sampling_params={"max_tokens": 16},
        kv_block_tokens=16,
        status=RequestStatus.RUNNING,
        owner_worker_id="w0",
    )


def _created(store: RequestStore) -> str:
    record = _record()
    store.create_request(record)
    return record.request_id


def test_a_record_is_created_once_and_read_back(make_store: StoreMaker) -> None:
    store = make_store(0)
    record = _record()
    store.create_request(record)
    with pytest.raises(RequestExists):
        store.create_request(record)
    loaded = store.get_request(record.request_id)
    assert (loaded.prompt_token_ids, loaded.owner_worker_id) == ((1, 2, 3), "w0")
    assert loaded.status == RequestStatus.RUNNING and loaded.committed_length == 0
    assert loaded.created_unix_ms > 0
    with pytest.raises(RequestNotFound):
        store.get_request("contract-nobody")
    assert (loaded.sla_class, loaded.priority) == ("INTERACTIVE", None)


def test_a_record_keeps_its_class_and_priority_for_a_resume(make_store: StoreMaker) -> None:
    store = make_store(0)
    record = dataclasses.replace(_record(), sla_class="BATCH", priority=7)
    store.create_request(record)
    loaded = store.get_request(record.request_id)
    assert (loaded.sla_class, loaded.priority) == ("BATCH", 7)


def test_token_commits_are_idempotent_and_never_gap_or_rewrite(make_store: StoreMaker) -> None:
    store = make_store(0)
    request_id = _created(store)
    first, retried, overlapping = store.commit_step(
        [
            TokenCommit(request_id, 0, (10, 11, 12)),
            TokenCommit(request_id, 0, (10, 11, 12)),  # a retry: accepted, nothing doubled
            TokenCommit(request_id, 2, (12, 13)),  # overlaps, then one new token
        ]
    )
    assert [o.committed_length for o in (first, retried, overlapping)] == [3, 3, 4]
    assert all(o.conflict is None for o in (first, retried, overlapping))
    gap, mismatch = store.commit_step(
        [TokenCommit(request_id, 6, (16,)), TokenCommit(request_id, 1, (99, 12))]
    )
    assert gap.conflict is not None and gap.conflict.reason is ConflictReason.GAP
    assert mismatch.conflict is not None and mismatch.conflict.reason is ConflictReason.MISMATCH
    assert store.committed_tokens(request_id) == [10, 11, 12, 13], "refusals wrote nothing"
    assert store.committed_tokens(request_id, 2) == [12, 13]
    assert store.get_request(request_id).committed_length == 4
    (unknown,) = store.commit_step([TokenCommit("contract-nobody", 0, (1,))])
    assert unknown.conflict is not None
    assert unknown.conflict.reason is ConflictReason.UNKNOWN_REQUEST


def test_status_moves_follow_the_lifecycle(make_store: StoreMaker) -> None:
    store = make_store(60)
    request_id = _created(store)
    assert store.update_status(request_id, RequestStatus.PAUSED) == RequestStatus.RUNNING
    assert store.update_status(request_id, RequestStatus.RUNNING, "w1") == RequestStatus.PAUSED
    assert store.get_request(request_id).owner_worker_id == "w1"
    assert store.finish_request(request_id, RequestStatus.CANCELLED)
    assert store.get_request(request_id).status == RequestStatus.CANCELLED, "kept: retention"
    with pytest.raises(InvalidTransition):
        store.update_status(request_id, RequestStatus.RUNNING)
    with pytest.raises(InvalidTransition):
        store.finish_request(request_id, RequestStatus.FINISHED)
    (late,) = store.commit_step([TokenCommit(request_id, 0, (1,))])
    assert late.conflict is not None and late.conflict.reason is ConflictReason.REQUEST_ENDED
    with pytest.raises(RequestNotFound):
        store.update_status("contract-nobody", RequestStatus.RUNNING)
    with pytest.raises(ValueError):
        store.update_status(request_id, RequestStatus.FINISHED)
    store.delete_request(request_id)


def test_a_finish_without_retention_deletes_and_a_second_finish_is_harmless(
    make_store: StoreMaker,
) -> None:
    store = make_store(0)
    request_id = _created(store)
    store.release_request(request_id)  # its client already got the end
    assert store.finish_request(request_id)
    with pytest.raises(RequestNotFound):
        store.get_request(request_id)
    assert not store.finish_request(request_id)
    cancelled = _created(store)
    assert store.finish_request(cancelled, RequestStatus.CANCELLED)  # never held
    with pytest.raises(RequestNotFound):
        store.get_request(cancelled)


def test_a_finished_request_is_kept_until_its_client_got_the_end(make_store: StoreMaker) -> None:
    """Retention 0, but nobody has said the client got the end: record and tokens stay (a
    coordinator restarted meanwhile replays them), until a release deletes them."""
    store = make_store(0)
    request_id = _created(store)
    store.commit_step([TokenCommit(request_id, 0, (5, 6, 7))])
    assert store.finish_request(request_id, RequestStatus.FINISHED, "LENGTH")
    held = store.get_request(request_id)
    assert (held.status, held.finish_reason, held.committed_length) == (
        RequestStatus.FINISHED,
        "LENGTH",
        3,
    )
    assert store.committed_tokens(request_id, 1) == [6, 7]
    assert store.release_request(request_id)
    with pytest.raises(RequestNotFound):
        store.get_request(request_id)
    assert not store.release_request(request_id)  # a second release is harmless


def test_a_release_before_the_finish_lets_the_finish_delete(make_store: StoreMaker) -> None:
    """The relay hands the client the worker's last chunk before the worker's finish lands
    in the store: the mark the release leaves makes that finish apply the retention."""
    store = make_store(0)
    request_id = _created(store)
    assert store.release_request(request_id)
    assert store.get_request(request_id).status is RequestStatus.RUNNING  # still live
    assert store.finish_request(request_id, RequestStatus.FINISHED, "STOP")
    with pytest.raises(RequestNotFound):
        store.get_request(request_id)


def test_delete_counts_the_keys_that_existed(make_store: StoreMaker) -> None:
    store = make_store(0)
    bare = _created(store)
    assert store.delete_request(bare) == 1
    with_tokens = _created(store)
    store.commit_step([TokenCommit(with_tokens, 0, (5,))])
    assert store.delete_request(with_tokens) == 2
    assert store.delete_request(with_tokens) == 0
