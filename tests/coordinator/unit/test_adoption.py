"""A restarted coordinator adopts what its predecessor left, in-process: the fake workers, the
in-memory store, route records in a dict. A request that finished while no coordinator was
up is replayed from the store from the client's next index, exactly once, and its keys go
once a reader got the end; one still RUNNING on a live worker is resumed on that worker,
never on a second one; one whose worker is gone resumes elsewhere."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from common.requests import FinishReason, TokenChunk
from coordinator.errors import UnknownRequest
from coordinator.route_records import RouteRecord
from store import RequestNotFound, RequestRecord, RequestStatus
from store.request_record import sampling_to_record
from tests.support.factories import (
    COORDINATOR_ADDRESS,
    RELEASE_RETRY_SECONDS,
    Cluster,
    make_request,
    read_all,
    tokens_of,
)
from tests.support.fake_worker import ScriptedStream, token_ids
from tests.support.wait import wait_until_async

Make = Callable[..., Cluster]
MAX_TOKENS = 10


def _left_behind(
    cluster: Cluster, request_id: str, committed: int, owner: str = "w1", route: str = "running"
) -> None:
    """What a coordinator that died left: its route record (written at this address, as a
    coordinator restarted on the same port finds it) and the worker's record with
    ``committed`` tokens, still RUNNING on ``owner``."""
    request = make_request(request_id, max_tokens=MAX_TOKENS)
    cluster.store.create_request(
        RequestRecord(
            request_id=request_id,
            model_fingerprint="f" * 32,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=sampling_to_record(request.sampling),
            kv_block_tokens=16,
            status=RequestStatus.RUNNING,
            owner_worker_id=owner,
        )
    )
    if committed:
        cluster.store.commit(request_id, 0, token_ids(0, committed))
    cluster.routes.records[request_id] = RouteRecord(
        request_id=request_id,
        coordinator_id="coordinator-before",
        owner_worker_id=owner,
        status=route,
        finish_reason="NONE",
        delivered_length=3,
        sla_class="INTERACTIVE",
        updated_unix_ms=1,
        coordinator_address=COORDINATOR_ADDRESS,
    )


async def _attach(cluster: Cluster, request_id: str, from_index: int) -> list[TokenChunk]:
    async def collect() -> list[TokenChunk]:
        return [c async for c in cluster.dispatcher.attach(request_id, from_index)]

    return await asyncio.wait_for(collect(), 5.0)


def _held(cluster: Cluster, request_id: str) -> bool:
    return request_id in cluster.store.request_ids()


@pytest.mark.parametrize("route", ["running", "finished"])
async def test_a_request_that_finished_while_no_coordinator_was_up_is_replayed_once(
    clusters: Make, route: str
) -> None:
    """Its worker finished it after the coordinator died (route: still running) or the dead
    coordinator had relayed the end but its client never got it (route: finished)."""
    cluster = clusters(workers=2, adoption=True)
    _left_behind(cluster, "done", MAX_TOKENS, route=route)
    cluster.store.finish_request("done", RequestStatus.FINISHED, FinishReason.LENGTH.name)
    assert _held(cluster, "done"), "kept: nobody has said its client got the end"

    chunks = await _attach(cluster, "done", 6)  # the client had indices 0..5
    assert tokens_of(chunks, 6) == list(token_ids(6, MAX_TOKENS))
    assert chunks[-1].finish_reason == FinishReason.LENGTH
    assert [c for c in chunks if c.finished] == chunks[-1:], "one end"
    assert not cluster.fakes.calls, "no worker was asked: the store had it all"
    await wait_until_async(lambda: not _held(cluster, "done"), "its keys released")

    # A second reader of the same coordinator is served from the relay it kept.
    again = await _attach(cluster, "done", 0)
    assert tokens_of(again) == list(token_ids(0, MAX_TOKENS))


async def test_a_request_released_before_the_restart_is_not_found(clusters: Make) -> None:
    cluster = clusters(workers=1, adoption=True)
    _left_behind(cluster, "gone", MAX_TOKENS, route="finished")
    cluster.store.release_request("gone")  # its client got the end from the old coordinator
    cluster.store.finish_request("gone", RequestStatus.FINISHED, FinishReason.LENGTH.name)
    with pytest.raises(RequestNotFound):
        cluster.store.get_request("gone")
    with pytest.raises(UnknownRequest):
        await _attach(cluster, "gone", 0)


async def test_a_request_that_finishes_during_the_pause_wait_is_replayed(clusters: Make) -> None:
    cluster = clusters(workers=2, adoption=True)
    _left_behind(cluster, "late", 4)
    attach = asyncio.ensure_future(_attach(cluster, "late", 2))
    await asyncio.sleep(0.05)  # the coordinator waits for the worker to pause it
    cluster.store.commit("late", 4, token_ids(4, 7))
    cluster.store.finish_request("late", RequestStatus.FINISHED, FinishReason.STOP.name)
    chunks = await attach
    assert tokens_of(chunks, 2) == list(token_ids(2, 7))
    assert chunks[-1].finish_reason == FinishReason.STOP
    assert not cluster.fakes.calls


async def test_a_paused_request_resumes_and_the_client_gets_each_index_once(
    clusters: Make,
) -> None:
    cluster = clusters(workers=2, adoption=True)
    _left_behind(cluster, "paused", 5)
    cluster.store.update_status("paused", RequestStatus.PAUSED)
    attach = asyncio.ensure_future(_attach(cluster, "paused", 3))
    relay_stream = await _resumed_stream(cluster, "paused")
    assert (relay_stream.call.what, relay_stream.call.index) == ("resume", 0)
    relay_stream.emit(0, 5)  # the resume replays what was committed, then goes on
    relay_stream.emit(5, MAX_TOKENS, FinishReason.LENGTH)
    chunks = await attach
    assert tokens_of(chunks, 3) == list(token_ids(3, MAX_TOKENS))


async def test_a_record_still_running_on_a_live_worker_resumes_on_that_worker(
    clusters: Make,
) -> None:
    """Its worker has not yet seen its old caller go: resuming it anywhere else would decode
    it twice. Its owner's Resume pauses the old run first (worker/streams.py)."""
    cluster = clusters(workers=2, adoption=True)
    busy = make_request("busy")
    cluster.submit(busy)  # w0 takes it: the least loaded worker is now w1 ...
    await cluster.worker(0).next_stream()
    _left_behind(cluster, "stuck", 4, owner="w0")  # ... but the stuck request runs on w0
    attach = asyncio.ensure_future(_attach(cluster, "stuck", 4))
    stream = await _resumed_stream(cluster, "stuck")
    assert stream.call.address == "w0", "resumed on its owner, not on a second worker"
    assert stream.call.what == "resume"
    stream.emit(0, MAX_TOKENS, FinishReason.LENGTH)
    assert tokens_of(await attach, 4) == list(token_ids(4, MAX_TOKENS))


async def test_a_record_running_on_a_stopped_worker_resumes_elsewhere_at_once(
    clusters: Make,
) -> None:
    cluster = clusters(workers=2, adoption=True, failover="resume")
    cluster.registry.deregister("w1")
    _left_behind(cluster, "orphan", 4, owner="w1")
    attach = asyncio.ensure_future(_attach(cluster, "orphan", 0))
    stream = await _resumed_stream(cluster, "orphan")
    assert stream.call.address == "w0"
    stream.emit(0, MAX_TOKENS, FinishReason.LENGTH)
    assert tokens_of(await attach) == list(token_ids(0, MAX_TOKENS))


async def test_a_relayed_request_is_released_once_a_reader_got_its_end(clusters: Make) -> None:
    cluster = clusters(workers=1, adoption=True)
    relay = cluster.submit(make_request("relayed", max_tokens=4))
    stream = await cluster.worker(0).next_stream()
    _left_behind(cluster, "relayed", 4, owner="w0")  # the worker's own record
    cluster.store.finish_request("relayed", RequestStatus.FINISHED, FinishReason.LENGTH.name)
    stream.emit(0, 4, FinishReason.LENGTH)
    await relay.wait_finished()
    assert _held(cluster, "relayed"), "finished, but no reader has had the end yet"
    assert tokens_of(await read_all(relay)) == list(token_ids(0, 4))
    await wait_until_async(lambda: not _held(cluster, "relayed"), "its keys released")


async def test_a_release_that_overtakes_the_workers_finish_still_ends_the_keys(
    clusters: Make,
) -> None:
    cluster = clusters(workers=1, adoption=True)
    relay = cluster.submit(make_request("quick", max_tokens=4))
    stream = await cluster.worker(0).next_stream()
    _left_behind(cluster, "quick", 4, owner="w0")
    stream.emit(0, 4, FinishReason.LENGTH)
    assert tokens_of(await read_all(relay)) == list(token_ids(0, 4))
    await asyncio.sleep(0.05)  # the release lands before the worker's finish
    assert cluster.store.get_request("quick").status is RequestStatus.RUNNING
    cluster.store.finish_request("quick", RequestStatus.FINISHED, FinishReason.LENGTH.name)
    assert not _held(cluster, "quick")


async def test_a_release_that_found_no_record_ends_the_keys_its_worker_writes_again(
    clusters: Make,
) -> None:
    """The store restarted empty while the request ran: its client gets the end before the
    worker has written the record again (with every token and its end). Released then, the
    record would keep its keys the undelivered retention."""
    cluster = clusters(workers=1, adoption=True)
    relay = cluster.submit(make_request("restarted", max_tokens=4))
    stream = await cluster.worker(0).next_stream()
    stream.emit(0, 4, FinishReason.LENGTH)
    assert tokens_of(await read_all(relay)) == list(token_ids(0, 4))
    await asyncio.sleep(0.2)  # the release found no record, maybe more than once
    _left_behind(cluster, "restarted", 4, owner="w0")  # the worker reached the store again
    cluster.store.finish_request("restarted", RequestStatus.FINISHED, FinishReason.LENGTH.name)
    assert _held(cluster, "restarted"), "finished, not released yet"
    await wait_until_async(lambda: not _held(cluster, "restarted"), "its keys released")


async def test_a_stopping_coordinator_does_not_wait_out_a_release_retry(clusters: Make) -> None:
    """A release still waiting for its record gives up when the coordinator stops, rather
    than holding the stop for its whole retry window."""
    cluster = clusters(workers=1, adoption=True)
    relay = cluster.submit(make_request("no-record", max_tokens=4))
    stream = await cluster.worker(0).next_stream()
    stream.emit(0, 4, FinishReason.LENGTH)
    assert tokens_of(await read_all(relay)) == list(token_ids(0, 4))
    await asyncio.sleep(0.1)  # the release found no record and waits to try again
    window = RELEASE_RETRY_SECONDS[1]
    await asyncio.wait_for(cluster.dispatcher.stop(), timeout=window / 2)


async def test_a_stopping_coordinator_lets_go_of_its_workers_streams(clusters: Make) -> None:
    """So that each worker pauses its request (resumable by the next coordinator) instead of
    decoding on for a relay that nobody reads any more."""
    cluster = clusters(workers=1, adoption=True)
    relay = cluster.submit(make_request("cut", max_tokens=MAX_TOKENS))
    stream = await cluster.worker(0).next_stream()
    stream.emit(0, 3)
    await cluster.dispatcher.stop()
    assert stream.closed and relay.finished


async def _resumed_stream(cluster: Cluster, request_id: str) -> ScriptedStream:
    """The Resume stream of ``request_id`` on whichever worker got it."""

    def opened() -> ScriptedStream | None:
        return next(
            (
                s
                for w in cluster.fakes.workers.values()
                for s in w.open_streams()
                if s.request_id == request_id
            ),
            None,
        )

    await wait_until_async(opened, f"a stream of {request_id}", 5.0)
    stream = opened()
    assert stream is not None
    return stream
