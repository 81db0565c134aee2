"""When a paused request's flush is complete without any KV in the store: its pause found none
of its KV computed (it was still queued), or every one of its tokens is committed (the
engine finished it as the pause cut the stream)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from store import RedisStore, RequestRecord, RequestStatus
from tests.support.redis_server import RedisServer
from worker.flush_state import read_flush_state

FINGERPRINT = "tiny-llama:fp32:flush"
BLOCK_TOKENS = 16
PROMPT = tuple(range(100, 140))  # 40 tokens: KV owed for 2 full blocks and a tail
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def store(redis_server: RedisServer) -> Iterator[RedisStore]:
    store = RedisStore.from_url(redis_server.url)
    yield store
    store.close()


def _paused(store: RedisStore, request_id: str, tokens: tuple[int, ...]) -> None:
    store.create_request(
        RequestRecord(
            request_id=request_id,
            model_fingerprint=FINGERPRINT,
            prompt_token_ids=PROMPT,
            sampling_params={"max_tokens": MAX_TOKENS},
            kv_block_tokens=BLOCK_TOKENS,
            status=RequestStatus.RUNNING,
            owner_worker_id="worker-a",
        )
    )
    if tokens:
        store.commit(request_id, 0, tokens)
    store.update_status(request_id, RequestStatus.PAUSED)


def _complete(store: RedisStore, request_id: str, streamed: int, with_kv: bool = True) -> bool:
    return read_flush_state(
        store, request_id, FINGERPRINT, BLOCK_TOKENS, streamed, with_kv
    ).complete


def test_kv_is_owed_for_the_context_of_a_paused_request(store: RedisStore) -> None:
    _paused(store, "flush-owed", (1, 2))
    assert not _complete(store, "flush-owed", 2)
    assert _complete(store, "flush-owed", 2, with_kv=False)


def test_a_pause_that_found_no_kv_owes_none(store: RedisStore) -> None:
    _paused(store, "flush-unstarted", ())
    assert not _complete(store, "flush-unstarted", 0)
    assert store.mark_paused_without_kv(["flush-unstarted"]) == [True]
    assert _complete(store, "flush-unstarted", 0)


def test_a_request_with_every_token_committed_owes_no_kv(store: RedisStore) -> None:
    _paused(store, "flush-all-tokens", (1, 2, 3, 4))
    assert _complete(store, "flush-all-tokens", 2)  # the stream was cut before the last two
