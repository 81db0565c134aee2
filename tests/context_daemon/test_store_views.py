"""RedisStore.request_views: many requests' records, tokens and tail headers in one round trip
(what a preempt flush polls), on a standalone server and on a cluster (keys on many slots)."""

from __future__ import annotations

from store import RedisStore, RequestStatus, block_reads
from tests.context_daemon.test_store_blocks import FORMAT, create, writes_for


def test_views_match_the_single_reads_for_every_request_and_none_for_unknown(
    store: RedisStore,
) -> None:
    with_tail = list(range(2000, 2000 + 16 * 2 + 5))  # two full blocks and a 5-token tail
    whole_blocks = list(range(3000, 3000 + 16))  # one full block, no tail
    first, second = create(store, with_tail[:10]), create(store, whole_blocks[:10])
    store.commit(first, 0, with_tail[10:])
    store.commit(second, 0, whole_blocks[10:])
    store.put_blocks(writes_for(first, with_tail) + writes_for(second, whole_blocks))
    store.update_status(first, RequestStatus.PAUSED)

    views = store.request_views([first, "no-such-request", second])

    assert list(views) == [first, "no-such-request", second]
    assert views["no-such-request"] is None
    for request_id, tokens in ((first, with_tail), (second, whole_blocks)):
        view = views[request_id]
        assert view is not None
        assert view.record == store.get_request(request_id)
        assert view.committed_tokens == store.committed_tokens(request_id) == tokens[10:]
        ((_, tail),) = store.shard_views({request_id: []}, [""])[request_id]
        assert view.tail == tail
    first_view, second_view = views[first], views[second]
    assert first_view is not None and second_view is not None
    assert first_view.record.status is RequestStatus.PAUSED
    tail_read = block_reads(first, FORMAT, with_tail)[-1]
    assert first_view.tail is not None
    assert (first_view.tail.num_tokens, first_view.tail.prefix_hash) == (5, tail_read.prefix_hash)
    assert second_view.tail is None


def test_no_requests_is_no_round_trip_and_no_views(store: RedisStore) -> None:
    assert store.request_views([]) == {}
