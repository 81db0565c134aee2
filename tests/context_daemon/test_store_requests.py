"""Request records and committed tokens in a real Redis (standalone and cluster)."""

from __future__ import annotations

import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store import (
    CommitConflict,
    ConflictReason,
    InvalidTransition,
    RedisStore,
    RequestExists,
    RequestNotFound,
    RequestRecord,
    RequestStatus,
    StoreConfig,
    TokenCommit,
)
from tests.context_daemon.conftest import TEST_STORE_CONFIG
from tests.support.wait import wait_until

FINGERPRINT = "tiny-llama:sha256:0123abcd"


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:12]}"


def make_record(request_id: str | None = None, prompt_len: int = 7) -> RequestRecord:
    return RequestRecord(
        request_id=request_id or new_request_id(),
        model_fingerprint=FINGERPRINT,
        prompt_token_ids=tuple(range(100, 100 + prompt_len)),
        sampling_params={"temperature": 0.0, "max_tokens": 64, "seed": 7},
        kv_block_tokens=16,
    )


def test_record_round_trip(store: RedisStore) -> None:
    record = make_record(prompt_len=300)
    store.create_request(record)
    loaded = store.get_request(record.request_id)
    assert loaded.prompt_token_ids == record.prompt_token_ids
    assert loaded.sampling_params == {"temperature": 0.0, "max_tokens": 64, "seed": 7}
    assert loaded.status is RequestStatus.QUEUED
    assert loaded.committed_length == 0
    assert loaded.created_unix_ms > 0
    assert loaded.persisted_block_hashes == ()


def test_create_twice_is_refused_and_keeps_the_first(store: RedisStore) -> None:
    record = make_record()
    store.create_request(record)
    store.commit(record.request_id, 0, [1, 2])
    with pytest.raises(RequestExists):
        store.create_request(make_record(record.request_id, prompt_len=3))
    assert store.get_request(record.request_id).prompt_token_ids == record.prompt_token_ids
    assert store.committed_tokens(record.request_id) == [1, 2]


def test_unknown_request(store: RedisStore) -> None:
    request_id = new_request_id()
    with pytest.raises(RequestNotFound):
        store.get_request(request_id)
    with pytest.raises(RequestNotFound):
        store.committed_tokens(request_id)
    with pytest.raises(CommitConflict) as conflict:
        store.commit(request_id, 0, [1])
    assert conflict.value.reason is ConflictReason.UNKNOWN_REQUEST
    assert store.keys_for_request(request_id) == []


def test_commits_append_retries_are_no_ops_and_gaps_or_rewrites_are_refused(
    store: RedisStore,
) -> None:
    request_id = make_and_create(store)
    assert store.commit(request_id, 0, [5, 6, 7]) == 3
    assert store.commit(request_id, 0, [5, 6, 7]) == 3  # exact retry
    assert store.commit(request_id, 1, [6]) == 3  # retry of a sub-range
    assert store.commit(request_id, 2, [7, 8, 9]) == 5  # retry merged with new tokens
    with pytest.raises(CommitConflict) as gap:
        store.commit(request_id, 6, [11])
    assert (gap.value.reason, gap.value.committed_length) == (ConflictReason.GAP, 5)
    with pytest.raises(CommitConflict) as rewrite:
        store.commit(request_id, 4, [99, 10])
    assert rewrite.value.reason is ConflictReason.MISMATCH
    assert store.committed_tokens(request_id) == [5, 6, 7, 8, 9]
    assert store.committed_tokens(request_id, start_index=3) == [8, 9]
    assert store.get_request(request_id).committed_length == 5


def test_one_step_commits_many_requests_and_a_conflict_spares_the_others(
    store: RedisStore,
) -> None:
    request_ids = [make_and_create(store) for _ in range(40)]
    first = store.commit_step([TokenCommit(rid, 0, (1, 2)) for rid in request_ids])
    assert [outcome.committed_length for outcome in first] == [2] * 40
    step = [TokenCommit(rid, 2, (3,)) for rid in request_ids]
    step[7] = TokenCommit(request_ids[7], 5, (3,))  # a gap for one request only
    step.append(TokenCommit(request_ids[0], 3, (4,)))  # two commits of one request, in order
    outcomes = store.commit_step(step)
    assert outcomes[7].conflict is not None
    assert outcomes[7].conflict.reason is ConflictReason.GAP
    assert all(o.conflict is None for i, o in enumerate(outcomes) if i != 7)
    assert store.committed_tokens(request_ids[0]) == [1, 2, 3, 4]
    assert store.committed_tokens(request_ids[7]) == [1, 2]
    assert store.committed_tokens(request_ids[39]) == [1, 2, 3]


def test_status_lifecycle_and_owner(store: RedisStore) -> None:
    request_id = make_and_create(store)
    assert store.update_status(request_id, RequestStatus.RUNNING, "worker-a") is (
        RequestStatus.QUEUED
    )
    store.update_status(request_id, RequestStatus.MIGRATING)
    store.update_status(request_id, RequestStatus.RUNNING, "worker-b")
    record = store.get_request(request_id)
    assert (record.status, record.owner_worker_id) == (RequestStatus.RUNNING, "worker-b")
    with pytest.raises(RequestNotFound):
        store.update_status(new_request_id(), RequestStatus.RUNNING)


def test_a_pause_without_kv_is_marked_until_the_request_runs_again(
    redis_client: redis.Redis | redis.RedisCluster,
) -> None:
    retaining = RedisStore(redis_client, StoreConfig(retention_seconds=120))
    request_id = make_and_create(retaining)
    retaining.update_status(request_id, RequestStatus.RUNNING, "worker-a")
    assert not retaining.get_request(request_id).paused_without_kv
    ended = make_and_create(retaining)
    retaining.finish_request(ended, RequestStatus.CANCELLED)
    missing = new_request_id()

    assert retaining.mark_paused_without_kv([request_id, ended, missing]) == [True, False, False]
    retaining.update_status(request_id, RequestStatus.PAUSED)
    assert retaining.get_request(request_id).paused_without_kv
    assert not retaining.get_request(ended).paused_without_kv
    assert retaining.keys_for_request(missing) == []  # a late mark creates nothing

    retaining.update_status(request_id, RequestStatus.RUNNING, "worker-b")
    assert not retaining.get_request(request_id).paused_without_kv
    assert retaining.mark_paused_without_kv([]) == []


def test_a_terminal_request_cannot_be_revived_or_extended(
    redis_client: redis.Redis | redis.RedisCluster,
) -> None:
    retaining = RedisStore(redis_client, StoreConfig(retention_seconds=120))
    request_id = make_and_create(retaining)
    retaining.commit(request_id, 0, [1])
    assert retaining.finish_request(request_id, RequestStatus.CANCELLED)
    assert retaining.finish_request(request_id, RequestStatus.CANCELLED)  # retry is harmless
    with pytest.raises(InvalidTransition):
        retaining.update_status(request_id, RequestStatus.RUNNING)
    with pytest.raises(InvalidTransition):
        retaining.finish_request(request_id, RequestStatus.FINISHED)
    with pytest.raises(CommitConflict) as late:
        retaining.commit(request_id, 1, [2])
    assert late.value.reason is ConflictReason.REQUEST_ENDED
    assert retaining.get_request(request_id).status is RequestStatus.CANCELLED
    assert retaining.committed_tokens(request_id) == [1]


def test_every_commit_restarts_the_abandonment_ttl(
    store: RedisStore, redis_client: redis.Redis | redis.RedisCluster
) -> None:
    request_id = make_and_create(store)
    store.commit(request_id, 0, [1])
    for key in store.request_ttl_seconds(request_id):
        redis_client.expire(key, 5)
    store.commit(request_id, 0, [1])  # even a pure retry proves the request is alive
    ttls = store.request_ttl_seconds(request_id)
    assert len(ttls) == 2  # meta and tokens exist
    assert all(store.config.request_ttl_seconds - 5 < ttl for ttl in ttls.values())


def test_abandoned_state_expires(redis_client: redis.Redis | redis.RedisCluster) -> None:
    short = RedisStore(redis_client, StoreConfig(request_ttl_seconds=1))
    request_id = make_and_create(short)
    short.commit(request_id, 0, [1, 2])
    wait_until(lambda: short.keys_for_request(request_id) == [], "its keys expired", 5, 0.05)
    with pytest.raises(RequestNotFound):
        short.get_request(request_id)


def test_finish_with_retention_keeps_state_readable_until_retention_ends(
    redis_client: redis.Redis | redis.RedisCluster,
) -> None:
    retaining = RedisStore(redis_client, StoreConfig(request_ttl_seconds=600, retention_seconds=30))
    request_id = make_and_create(retaining)
    retaining.commit(request_id, 0, [4, 5])
    retaining.finish_request(request_id)
    assert retaining.get_request(request_id).status is RequestStatus.FINISHED
    ttls = retaining.request_ttl_seconds(request_id)
    hold = StoreConfig().undelivered_retention_seconds  # nobody released it yet
    assert ttls and all(30 < ttl <= hold for ttl in ttls.values())
    assert retaining.release_request(request_id)  # its client got the end
    ttls = retaining.request_ttl_seconds(request_id)
    assert ttls and all(0 < ttl <= 30 for ttl in ttls.values())


def test_finish_without_retention_and_delete_leave_nothing(store: RedisStore) -> None:
    finished = make_and_create(store)
    store.commit(finished, 0, [1, 2, 3])
    assert store.keys_for_request(finished)
    assert store.finish_request(finished)
    assert store.keys_for_request(finished), "kept until its client got the end"
    ttls = store.request_ttl_seconds(finished)
    hold = TEST_STORE_CONFIG.undelivered_retention_seconds
    assert ttls and all(0 < ttl <= hold for ttl in ttls.values())
    assert store.release_request(finished)
    assert store.keys_for_request(finished) == []
    assert not store.finish_request(finished)  # already gone: a retried finish is harmless

    deleted = make_and_create(store)
    store.commit(deleted, 0, [1])
    assert store.delete_request(deleted) == 2
    assert store.keys_for_request(deleted) == []
    with pytest.raises(CommitConflict):
        store.commit(deleted, 1, [2])  # a late commit must not resurrect keys
    assert store.keys_for_request(deleted) == []


def test_request_ids_with_glob_characters_do_not_match_other_requests(store: RedisStore) -> None:
    starry = f"a*{uuid.uuid4().hex[:6]}"
    plain = starry.replace("*", "b")
    store.create_request(make_record(starry))
    store.create_request(make_record(plain))
    assert store.keys_for_request(starry) == [f"si:v1:req:{{{starry}}}:meta"]
    store.delete_request(starry)
    store.delete_request(plain)


# --- property: retries in any order never duplicate, reorder or leave a gap ---------------------


@st.composite
def commit_histories(draw: st.DrawFn) -> tuple[list[int], list[tuple[int, int, bool]]]:
    """A token sequence and a shuffled history of commit attempts over ranges of it.

    Each attempt is (start, end, corrupt): corrupt attempts carry one wrong token, as a buggy
    or confused sender would.
    """
    tokens = draw(st.lists(st.integers(0, 50_000), min_size=1, max_size=40))
    cuts = (
        sorted(set(draw(st.lists(st.integers(1, len(tokens) - 1), max_size=8))))
        if len(tokens) > 1
        else []
    )
    bounds = [0, *cuts, len(tokens)]
    chunks = list(zip(bounds, bounds[1:], strict=False))
    attempts = draw(
        st.lists(
            st.tuples(st.sampled_from(chunks), st.sampled_from(chunks), st.booleans()),
            max_size=30,
        )
    )
    history = [(min(a[0], b[0]), max(a[1], b[1]), corrupt) for a, b, corrupt in attempts]
    return tokens, history


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=commit_histories())
def test_any_retry_order_yields_a_prefix_and_finally_the_exact_sequence(
    redis_client: redis.Redis | redis.RedisCluster,
    case: tuple[list[int], list[tuple[int, int, bool]]],
) -> None:
    tokens, history = case
    store = RedisStore(redis_client, StoreConfig(request_ttl_seconds=600))
    request_id = make_and_create(store)
    length = 0
    for start, end, corrupt in history:
        sent = list(tokens[start:end])
        if corrupt:
            sent[-1] = sent[-1] + 1
        (outcome,) = store.commit_step([TokenCommit(request_id, start, tuple(sent))])
        if start > length:
            assert outcome.conflict is not None
            assert outcome.conflict.reason is ConflictReason.GAP
        elif corrupt and end - 1 < length:
            assert outcome.conflict is not None
            assert outcome.conflict.reason is ConflictReason.MISMATCH
        else:
            assert outcome.conflict is None
            length = max(length, end)
            if corrupt:  # the wrong token landed beyond what was stored: it is now "the truth"
                tokens = tokens[: end - 1] + [sent[-1]] + tokens[end:]
        assert store.committed_tokens(request_id) == tokens[:length]
    store.commit(request_id, length, tokens[length:])
    assert store.committed_tokens(request_id) == tokens
    store.delete_request(request_id)


# --- helpers --------------------------------------------------------------------------------


def make_and_create(store: RedisStore) -> str:
    record = make_record()
    store.create_request(record)
    return record.request_id
