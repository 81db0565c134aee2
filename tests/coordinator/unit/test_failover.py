"""Failover policies in-process: what `fail`, `reroute` and `resume` do with the requests of
a worker whose stream broke or that the heartbeat lost."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from common.requests import EventKind, FinishReason, TokenChunk
from coordinator.failover import ResumeFromStore
from coordinator.heartbeat import Heartbeat
from coordinator.relay import Relay
from store import MemoryStore, RequestRecord
from tests.support.factories import (
    LOST_AFTER_SECONDS,
    Cluster,
    events_of,
    make_request,
    make_worker_entry,
    read_all,
    tokens_of,
)
from tests.support.fake_worker import FakeWorker, ScriptedStream, token_ids

Make = Callable[..., Cluster]
PROMPT_LEN = 4


async def _running(
    cluster: Cluster, request_id: str = "r", max_tokens: int = 10, delivered: int = 3
) -> tuple[Relay, ScriptedStream, asyncio.Task[list[TokenChunk]]]:
    """A request on w0 that has delivered ``delivered`` tokens, and its reader."""
    relay = cluster.submit(make_request(request_id, PROMPT_LEN, max_tokens))
    stream = await cluster.worker(0).next_stream()
    reader = asyncio.ensure_future(read_all(relay))
    stream.emit(0, delivered)
    return relay, stream, reader


async def _lose(cluster: Cluster, worker: FakeWorker) -> None:
    """The heartbeat stops hearing ``worker``: it turns LOST (the others keep answering)."""
    worker.down = True
    cluster.clock.advance(LOST_AFTER_SECONDS + 1)
    await Heartbeat(cluster.registry, interval_seconds=1.0).beat()


async def test_fail_ends_the_request_with_an_error_and_moves_nothing(clusters: Make) -> None:
    cluster = clusters(workers=2, failover="fail")
    relay, stream, reader = await _running(cluster)
    stream.fail()
    chunks = await reader
    assert tokens_of(chunks) == list(token_ids(0, 3))
    assert chunks[-1].finish_reason == FinishReason.ERROR
    assert "does not fail over" in events_of(chunks)[-1].detail
    assert [c.what for c in cluster.fakes.calls] == ["generate"], "no other worker was asked"


async def test_resume_continues_on_another_worker_from_the_first_undelivered_index(
    clusters: Make,
) -> None:
    cluster = clusters(workers=2, failover="resume")
    relay, stream, reader = await _running(cluster)
    await _lose(cluster, cluster.worker(0))
    resumed = await cluster.worker(1).next_stream()
    assert (resumed.call.what, resumed.call.request_id, resumed.call.index) == ("resume", "r", 3)
    # The resume continues from what the client has, whatever the store holds.
    assert resumed.call.delivered == token_ids(0, 3)
    assert stream.closed, "the lost worker's stream is no longer read"
    resumed.emit(3, 10, FinishReason.LENGTH)
    chunks = await reader
    assert tokens_of(chunks) == list(token_ids(0, 10))
    assert chunks[-1].finish_reason == FinishReason.LENGTH
    assert cluster.entry(0).in_flight_total == 0 and cluster.entry(1).in_flight_total == 0


async def test_resume_starts_afresh_a_request_the_lost_worker_never_persisted(
    clusters: Make,
) -> None:
    cluster = clusters(workers=2, failover="resume")
    relay = cluster.submit(make_request("r", PROMPT_LEN, 5))
    first = await cluster.worker(0).next_stream()
    reader = asyncio.ensure_future(read_all(relay))
    cluster.worker(1).persisted = set()  # the store holds nothing of it
    first.fail()  # before any token
    resumed = await cluster.worker(1).next_stream()
    fresh = await cluster.worker(1).next_stream()
    assert (resumed.call.what, fresh.call.what) == ("resume", "generate")
    fresh.emit(0, 5, FinishReason.LENGTH)
    assert tokens_of(await reader) == list(token_ids(0, 5))


async def test_resume_fails_a_request_with_tokens_out_but_nothing_persisted(
    clusters: Make,
) -> None:
    cluster = clusters(workers=2, failover="resume")
    relay, stream, reader = await _running(cluster)
    cluster.worker(1).persisted = set()
    stream.fail()
    chunks = await reader
    assert chunks[-1].finish_reason == FinishReason.ERROR
    assert "holds no record" in events_of(chunks)[-1].detail
    assert "generate" not in [c.what for c in cluster.fakes.calls if c.address == "w1"]


async def test_resume_gives_up_when_no_worker_is_left(clusters: Make) -> None:
    cluster = clusters(workers=1, failover="resume")
    relay, stream, reader = await _running(cluster)
    stream.fail()
    chunks = await reader
    assert chunks[-1].finish_reason == FinishReason.ERROR
    assert "no worker left" in events_of(chunks)[-1].detail


async def test_resume_gives_up_after_its_attempts(clusters: Make) -> None:
    cluster = clusters(workers=2, failover="resume")
    relay, stream, reader = await _running(cluster)
    heartbeat = Heartbeat(cluster.registry, interval_seconds=1.0)
    stream.fail()
    for attempt in range(ResumeFromStore.MAX_ATTEMPTS):
        # The two workers take turns; each answers its heartbeat, then breaks the stream.
        worker = cluster.worker((attempt + 1) % 2)
        resumed = await worker.next_stream()
        await heartbeat.beat()
        resumed.fail()
    chunks = await reader
    assert chunks[-1].finish_reason == FinishReason.ERROR
    assert "gave up" in events_of(chunks)[-1].detail
    assert relay.interruptions == ResumeFromStore.MAX_ATTEMPTS + 1


async def test_reroute_restarts_from_the_prompt_under_a_new_id_and_drops_the_old_state(
    clusters: Make,
) -> None:
    store = MemoryStore()
    store.create_request(
        RequestRecord("r", "tiny", tuple(range(1, PROMPT_LEN + 1)), {"max_tokens": 10}, 16)
    )
    cluster = clusters(workers=2, failover="reroute", store=store)
    relay, stream, reader = await _running(cluster)
    stream.fail()
    restarted = await cluster.worker(1).next_stream()
    assert (restarted.call.what, restarted.call.request_id) == ("generate", "r.r1")
    restarted.emit(0, 10, FinishReason.LENGTH)  # computes everything again
    chunks = await reader
    assert tokens_of(chunks) == list(token_ids(0, 10)), "the client gets no token twice"
    recovered = [e for e in events_of(chunks) if e.kind == EventKind.RECOVERED]
    assert len(recovered) == 1
    assert recovered[0].recomputed_tokens == PROMPT_LEN + 3
    assert (recovered[0].from_worker, recovered[0].to_worker) == ("w0", "w1")
    assert store.request_ids() == [], "the interrupted attempt's record is gone"


@pytest.mark.parametrize(
    ("policy", "call", "finish"),
    [
        ("fail", None, FinishReason.ERROR),
        ("resume", ("resume", "", 2), FinishReason.LENGTH),
        ("reroute", ("generate", ".r1", 0), FinishReason.LENGTH),
    ],
)
async def test_what_each_policy_does_with_every_request_of_a_lost_worker(
    clusters: Make, policy: str, call: tuple[str, str, int] | None, finish: FinishReason
) -> None:
    cluster = clusters(workers=1, failover=policy)
    relays = [cluster.submit(make_request(f"r{i}", PROMPT_LEN, 6)) for i in range(3)]
    readers = [asyncio.ensure_future(read_all(relay)) for relay in relays]
    lost = cluster.worker(0)
    for _ in relays:
        (await lost.next_stream()).emit(0, 2)
    make_worker_entry(cluster.registry, "w1")  # where they can go
    await _lose(cluster, lost)
    other = cluster.worker(1)
    if call is not None:
        for _ in relays:
            stream = await other.next_stream()
            what, suffix, index = call
            assert stream.call.what == what and stream.call.request_id.endswith(suffix)
            assert stream.call.index == index
            stream.emit(index, 6, FinishReason.LENGTH)
    for reader in readers:
        chunks = await reader
        assert chunks[-1].finish_reason == finish
        expected = 6 if finish == FinishReason.LENGTH else 2
        assert tokens_of(chunks) == list(token_ids(0, expected))
    if call is None:
        assert [c for c in cluster.fakes.calls if c.address == "w1"] == [], "nothing moved"
