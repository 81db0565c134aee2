"""The staged migration in-process: on a notice the coordinator reserves a target, has it
prefetch, then has the source's daemon flush, and resumes on the reserved target; every way
the handshake aborts frees the reservation (and what was staged), and the request then moves
the plain way."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence

from common.requests import FinishReason, TokenChunk
from context_daemon.worker_link import FlushReport
from coordinator.registry import WorkerState
from coordinator.relay import Relay, RelayStatus
from coordinator.worker_client import PrefetchResult
from tests.support.factories import Cluster, make_request, read_all, tokens_of
from tests.support.fake_worker import ScriptedStream, complete_report, refused, token_ids
from tests.support.wait import wait_until_async

Make = Callable[..., Cluster]
GRACE_SECONDS = 60.0
DELIVERED = 5
MAX_TOKENS = 20


class Source:
    """The noticed worker w0 with one request on it, 5 tokens out; its daemon's Flush pauses
    the request there (and reports it, unless told not to)."""

    def __init__(self, cluster: Cluster, relay: Relay, stream: ScriptedStream) -> None:
        self.cluster = cluster
        self.relay = relay
        self.stream = stream
        self.reader: asyncio.Task[list[TokenChunk]] = asyncio.ensure_future(read_all(relay))
        self.report = True
        self.at_flush: dict[str, int] = {}  # slots in use per worker when the flush came
        self.before_pause: Callable[[], None] = lambda: None
        cluster.daemons["d-w0"].reports = self._flush

    def _flush(self) -> Sequence[FlushReport]:
        self.at_flush = {e.address: e.in_flight_total for e in self.cluster.registry}
        self.before_pause()
        if self.relay.finished or self.stream.closed:
            return []
        self.stream.pause(DELIVERED)
        return [complete_report("r", "w0", DELIVERED)] if self.report else []

    def notice(self, grace_seconds: float = GRACE_SECONDS) -> None:
        self.cluster.migrations.inject(self.cluster.entry(0), grace_seconds, flush=True)

    def what(self) -> list[tuple[str, str, int]]:
        return [(c.address, c.what, c.index) for c in self.cluster.fakes.calls]


async def _source(cluster: Cluster) -> Source:
    for daemon in cluster.daemons.values():
        await asyncio.wait_for(daemon.subscribed.wait(), 5)
    relay = cluster.submit(make_request("r", 4, MAX_TOKENS))
    stream = await cluster.worker(0).next_stream()
    stream.emit(0, DELIVERED)
    await wait_until_async(lambda: relay.delivered_tokens == DELIVERED, timeout=5)
    return Source(cluster, relay, stream)


async def _finish_on(cluster: Cluster, index: int, source: Source) -> list[TokenChunk]:
    stream = await cluster.worker(index).stream_of("r")
    stream.emit(DELIVERED, MAX_TOKENS, FinishReason.LENGTH)
    chunks = await source.reader
    assert tokens_of(chunks) == list(token_ids(0, MAX_TOKENS)), "each index once"
    return chunks


async def test_reserve_prefetch_flush_then_resume_on_the_reserved_target(clusters: Make) -> None:
    cluster = clusters(workers=2, with_daemons=True)
    source = await _source(cluster)
    source.notice()
    await _finish_on(cluster, 1, source)
    assert source.what() == [
        ("w0", "generate", 0),
        ("w1", "prefetch", 0),  # staged while w0 still decoded
        ("d-w0", "flush", 0),  # then the pause
        ("w1", "resume", DELIVERED),  # where it was staged, from the first undelivered index
    ]
    assert source.at_flush["w1"] == 1, "the target's slot was reserved before the pause"
    assert [e.in_flight_total for e in cluster.registry] == [0, 0]
    assert [e.reserved_kv_blocks for e in cluster.registry] == [0, 0]


async def test_a_target_that_refuses_frees_its_reservation_and_the_request_moves_after_the_pause(
    clusters: Make,
) -> None:
    cluster = clusters(workers=2, with_daemons=True)
    cluster.worker(1).prefetch_script["r"] = [refused()]
    source = await _source(cluster)
    source.notice()
    await _finish_on(cluster, 1, source)
    assert source.at_flush["w1"] == 0, "the refused reservation was given back"
    assert ("w1", "drop_prefetch", 0) not in source.what(), "nothing was staged to drop"
    assert source.what()[-1] == ("w1", "resume", DELIVERED)


async def test_a_request_that_finishes_while_staged_frees_its_target(clusters: Make) -> None:
    cluster = clusters(workers=2, with_daemons=True)
    # The target's first stage finds the request over (the source finished it meanwhile).
    cluster.worker(1).prefetch_script["r"] = [PrefetchResult(2, 2, 2 << 20, 64, True)]
    source = await _source(cluster)
    source.before_pause = lambda: source.stream.emit(DELIVERED, MAX_TOKENS, FinishReason.LENGTH)
    source.notice()
    chunks = await source.reader
    assert tokens_of(chunks) == list(token_ids(0, MAX_TOKENS))
    await wait_until_async(lambda: ("w1", "drop_prefetch", 0) in source.what(), timeout=5)
    assert source.at_flush["w1"] == 0
    assert [c for c in source.what() if c[1] in ("resume", "generate") and c[0] == "w1"] == []


async def test_a_target_that_goes_away_mid_handshake_is_replaced_after_the_pause(
    clusters: Make,
) -> None:
    # The standby s0 is the target (promoted before the busy peer w1: pool_tiers) and goes
    # away before the pause; w1 takes the request.
    cluster = clusters(workers=2, standbys=1, with_daemons=True)
    source = await _source(cluster)
    target = cluster.entry(2)
    source.before_pause = lambda: cluster.registry.set_orchestrated_state(
        target, WorkerState.STOPPED
    )
    source.notice()
    await _finish_on(cluster, 1, source)
    assert ("s0", "drop_prefetch", 0) in source.what(), "what it staged is dropped"
    assert source.what()[-1] == ("w1", "resume", DELIVERED)
    assert target.in_flight_total == 0


async def test_a_source_that_dies_before_its_flush_report_is_recovered_at_once(
    clusters: Make,
) -> None:
    cluster = clusters(workers=2, with_daemons=True)
    source = await _source(cluster)
    source.report = False  # the pause happens, its report never comes
    source.notice()
    await wait_until_async(lambda: source.relay.status == RelayStatus.SWITCHING, timeout=5)
    # Waiting for the report now (for up to the grace): the source dies instead.
    cluster.registry.set_orchestrated_state(cluster.entry(0), WorkerState.STOPPED)
    await _finish_on(cluster, 1, source)
    assert source.what()[-1] == ("w1", "resume", DELIVERED)


async def test_a_short_notice_skips_staging_and_flushes_at_once(clusters: Make) -> None:
    cluster = clusters(workers=2, with_daemons=True)
    source = await _source(cluster)
    source.notice(grace_seconds=5.0)  # under STAGING_MIN_LEFT_SECONDS: the flush needs it all
    await _finish_on(cluster, 1, source)
    assert [c[1] for c in source.what()] == ["generate", "flush", "resume"]


async def test_a_noticed_worker_takes_no_new_request(clusters: Make) -> None:
    cluster = clusters(workers=2, with_daemons=True)
    source = await _source(cluster)
    source.notice()
    assert cluster.entry(0).state == WorkerState.PREEMPTED
    cluster.submit(make_request("later", 4, 4))
    (await cluster.worker(1).stream_of("later")).emit(0, 4, FinishReason.LENGTH)
    await _finish_on(cluster, 1, source)
    assert [c[0] for c in source.what() if c[1] == "generate"] == ["w0", "w1"]


async def test_a_worker_that_says_it_is_stopping_has_its_requests_moved_as_on_a_notice(
    clusters: Make,
) -> None:
    """SIGTERM of a worker (a scale-in, a MIG delete, a shutdown): its Stats carry the time it
    leaves, and the coordinator stages, flushes and resumes as on a notice."""
    cluster = clusters(workers=2, with_daemons=True)
    source = await _source(cluster)
    stopping = dataclasses.replace(
        cluster.worker(0).capacity,
        draining=True,
        stopping_deadline_unix=cluster.clock() + GRACE_SECONDS,
    )
    cluster.registry.record_heartbeat(cluster.entry(0), stopping, cluster.registry.now())
    cluster.registry.refresh()
    assert cluster.entry(0).state == WorkerState.PREEMPTED
    await _finish_on(cluster, 1, source)
    assert [c[1] for c in source.what()] == ["generate", "prefetch", "flush", "resume"]


async def test_a_rebalance_hint_moves_requests_only_when_the_policy_says_so(
    clusters: Make,
) -> None:
    cluster = clusters(workers=2, with_daemons=True)
    source = await _source(cluster)
    cluster.daemons["d-w0"].notice(0.0, action="rebalance")
    await wait_until_async(cluster.daemons["d-w0"].delivered, timeout=5)
    assert cluster.entry(0).state == WorkerState.READY, "ignored by default"
    cluster.migrations.migrate_on_rebalance = True
    cluster.daemons["d-w0"].notice(0.0, action="rebalance")
    await wait_until_async(lambda: cluster.entry(0).state == WorkerState.PREEMPTED, timeout=5)
    await _finish_on(cluster, 1, source)
    assert [c[1] for c in source.what()] == ["generate", "prefetch", "flush", "resume"]
