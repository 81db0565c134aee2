"""Capacity gaps in-process: a request that finds no worker waits for one up to
`capacity_wait_seconds`, is placed when one becomes ready, and is refused past the bound with
RESOURCE_EXHAUSTED and a retry hint; requests already admitted that wait to move are never
refused, but take places of the queue. The clock is the registry's manual one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from common.requests import FinishReason, SlaClass
from coordinator.admission import Admission, Ticket
from coordinator.batch_files import BatchLine
from coordinator.batch_lines import Busy, DispatcherLines
from coordinator.config import CoordinatorConfig
from coordinator.errors import NoWorkerInTime, QueueFull
from coordinator.registry import Registry, WorkerState
from tests.support.clock import ManualClock
from tests.support.factories import (
    Cluster,
    make_admission,
    make_limits,
    make_registry,
    make_request,
    make_worker_entry,
    read_all,
    tokens_of,
)
from tests.support.fake_worker import token_ids

Make = Callable[..., Cluster]
WAIT_SECONDS = 60.0
RETRY_AFTER_MS = 250


def _gap(slots: int = 4, queue_capacity: int = 8) -> tuple[Registry, Admission, ManualClock]:
    """No worker at all yet; requests wait WAIT_SECONDS for one."""
    registry, _, clock = make_registry()
    limits = make_limits(
        queue_capacity=queue_capacity,
        max_seqs_per_worker=slots,
        retry_after_ms=RETRY_AFTER_MS,
        capacity_wait_seconds=WAIT_SECONDS,
    )
    return registry, make_admission(registry, limits), clock


def _refusal(ticket: Ticket) -> NoWorkerInTime:
    error = ticket.future.exception()
    assert isinstance(error, NoWorkerInTime), f"refused with {error!r}"
    return error


async def test_a_request_that_finds_no_worker_waits_and_is_placed_when_one_becomes_ready() -> None:
    registry, admission, clock = _gap()
    ticket = admission.enqueue(make_request("r0"))
    assert not ticket.future.done() and admission.depth(SlaClass.INTERACTIVE) == 1
    clock.advance(WAIT_SECONDS - 1)
    admission.pump()  # a heartbeat: still nobody
    assert not ticket.future.done()

    worker = make_worker_entry(registry, "w0")
    admission.pump()  # the heartbeat after its registration
    assert ticket.future.result().entry is worker
    assert admission.depth(SlaClass.INTERACTIVE) == 0


async def test_past_the_wait_a_new_arrival_is_refused_with_a_retry_hint_and_holds_nothing() -> None:
    registry, admission, clock = _gap()
    ticket = admission.enqueue(make_request("r0"))
    clock.advance(WAIT_SECONDS - 0.5)
    admission.pump()
    assert not ticket.future.done()
    clock.advance(0.5)
    admission.pump()

    refusal = _refusal(ticket)
    assert refusal.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED and refusal.http_status == 429
    assert "no worker became available within 60 s" in str(refusal)
    assert refusal.trailing_metadata() == (("retry-after-ms", str(RETRY_AFTER_MS)),)
    assert refusal.http_headers()["Retry-After"] == "1"
    assert admission.depth(SlaClass.INTERACTIVE) == 0
    admission.withdraw(ticket)  # its relay's cleanup: nothing to give back, nothing raised

    worker = make_worker_entry(registry, "w0")
    admission.pump()
    assert worker.in_flight_total == 0 and worker.reserved_kv_blocks == 0, "no slot leaked"


async def test_the_wait_counts_from_the_start_of_the_gap_for_a_request_queued_before_it() -> None:
    registry, admission, clock = _gap(slots=1)
    worker = make_worker_entry(registry, "w0")
    admission.enqueue(make_request("holder"))
    waiting = admission.enqueue(make_request("waiting"))  # for the slot, not for a worker
    clock.advance(WAIT_SECONDS * 2)
    admission.pump()
    assert not waiting.future.done(), "a worker is ready: no bound on waiting for a slot"

    registry.set_orchestrated_state(worker, WorkerState.PREEMPTED)
    admission.pump()  # the gap starts
    clock.advance(WAIT_SECONDS - 1)
    admission.pump()
    assert not waiting.future.done()
    clock.advance(1)
    admission.pump()
    assert isinstance(_refusal(waiting), NoWorkerInTime)


async def test_moving_requests_are_never_refused_and_take_places_of_the_queue() -> None:
    registry, admission, clock = _gap(slots=1, queue_capacity=3)
    sources = [make_worker_entry(registry, name) for name in ("w0", "w1")]
    running = [admission.enqueue(make_request(f"m{i}")) for i in range(2)]
    for source in sources:
        registry.set_orchestrated_state(source, WorkerState.PREEMPTED)
    moving = [
        admission.requeue(t.request, frozenset({t.future.result().entry.address})) for t in running
    ]
    assert admission.depth(SlaClass.INTERACTIVE) == 2

    arrival = admission.enqueue(make_request("new"))  # the one place the moving ones left
    with pytest.raises(QueueFull):
        admission.enqueue(make_request("refused"))
    clock.advance(WAIT_SECONDS * 10)
    admission.pump()
    assert isinstance(_refusal(arrival), NoWorkerInTime)
    assert not any(t.future.done() for t in moving), "an admitted request is never refused"
    assert admission.depth(SlaClass.INTERACTIVE) == 2

    late = admission.enqueue(make_request("late"))
    replacement = make_worker_entry(registry, "w2")
    admission.pump()
    placed = [t.future.result().entry for t in moving if t.future.done()]
    assert placed == [replacement], "the first slot goes to a moving one: they keep the head"
    assert not late.future.done()


async def test_a_refused_request_reaches_its_reader_and_its_id_can_be_submitted_again(
    clusters: Make,
) -> None:
    cluster = clusters(workers=0, limits=make_limits(capacity_wait_seconds=WAIT_SECONDS))
    relay = cluster.submit(make_request("r", max_tokens=4))  # no worker ever: checked later
    reader = asyncio.ensure_future(read_all(relay))
    await asyncio.sleep(0)
    cluster.clock.advance(WAIT_SECONDS)
    cluster.admission.pump()
    with pytest.raises(NoWorkerInTime):
        await reader
    assert relay.finish_reason == FinishReason.ERROR and relay.delivered_tokens == 0

    again = cluster.submit(make_request("r", max_tokens=4))
    assert again is not relay, "the refused request's id is free"
    make_worker_entry(cluster.registry, "w0")
    cluster.admission.pump()
    stream = await cluster.worker(0).next_stream()
    stream.emit(0, 4, FinishReason.LENGTH)
    assert tokens_of(await read_all(again)) == list(token_ids(0, 4))
    assert cluster.entry(0).in_flight_total == 0


async def test_a_batch_line_refused_after_the_wait_is_tried_again_later(clusters: Make) -> None:
    cluster = clusters(workers=0, limits=make_limits(capacity_wait_seconds=WAIT_SECONDS))
    lines = DispatcherLines(cluster.dispatcher, "tiny")
    line = BatchLine(0, 1, "line-0", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4})
    run = asyncio.ensure_future(lines.run("batch-line-0", line, "", attach=False))
    while cluster.admission.depth(SlaClass.BATCH) == 0:
        await asyncio.sleep(0)
    cluster.clock.advance(WAIT_SECONDS)
    cluster.admission.pump()
    with pytest.raises(Busy, match="within 60 s"):
        await asyncio.wait_for(run, 5)


@pytest.mark.parametrize("seconds", [-1.0, float("nan"), float("inf")])
def test_the_capacity_wait_is_a_finite_number_of_seconds(seconds: float) -> None:
    with pytest.raises(ValueError, match="capacity_wait_seconds"):
        CoordinatorConfig(capacity_wait_seconds=seconds)
    assert CoordinatorConfig(capacity_wait_seconds=0).capacity_wait_seconds == 0
