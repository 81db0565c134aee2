"""Admission in-process: who gets a slot, who waits, in what order, and who is refused."""

from __future__ import annotations

import pytest

from common.requests import SlaClass
from coordinator.admission import Admission
from coordinator.errors import NoWorkerAvailable, QueueFull
from coordinator.registry import WorkerRole, WorkerState
from tests.support.factories import (
    make_admission,
    make_limits,
    make_registry,
    make_request,
    make_worker_entry,
)


def _one_worker(slots: int, **limits: int) -> Admission:
    registry, _, _ = make_registry()
    make_worker_entry(registry, "w0")
    return make_admission(registry, make_limits(max_seqs_per_worker=slots, **limits))


async def test_requests_beyond_the_slots_wait_and_run_first_come_first_served() -> None:
    admission = _one_worker(slots=2)
    tickets = {
        t.request.request_id: t
        for t in (admission.enqueue(make_request(f"r{i}")) for i in range(5))
    }
    assert [rid for rid, t in tickets.items() if t.future.done()] == ["r0", "r1"]
    assert admission.depth(SlaClass.INTERACTIVE) == 3

    started = ["r0", "r1"]
    for finishing in ["r0", "r1", "r2"]:
        tickets[finishing].future.result().release()
        started += [rid for rid, t in tickets.items() if t.future.done() and rid not in started]
    assert started == ["r0", "r1", "r2", "r3", "r4"]
    assert admission.depth(SlaClass.INTERACTIVE) == 0


async def test_a_freed_slot_goes_to_a_waiting_interactive_request_before_an_older_batch_one() -> (
    None
):
    admission = _one_worker(slots=1)
    holder = admission.enqueue(make_request("holder"))
    batch = admission.enqueue(make_request("batch", sla=SlaClass.BATCH))
    interactive = admission.enqueue(make_request("interactive"))
    assert not batch.future.done() and not interactive.future.done()

    holder.future.result().release()
    assert interactive.future.done(), "INTERACTIVE is served first"
    assert not batch.future.done()
    interactive.future.result().release()
    assert batch.future.done()


async def test_batch_takes_a_slot_that_waiting_interactive_requests_cannot_use() -> None:
    # Three slots, at most two INTERACTIVE: the third waits although a slot is free...
    admission = _one_worker(slots=3, interactive_cap=2)
    first = [admission.enqueue(make_request(f"i{i}")) for i in range(3)]
    assert [t.future.done() for t in first] == [True, True, False]
    # ...and that slot goes to BATCH rather than stay idle.
    batch = admission.enqueue(make_request("b0", sla=SlaClass.BATCH))
    assert batch.future.done()
    assert admission.running(SlaClass.BATCH) == 1 and admission.running(SlaClass.INTERACTIVE) == 2
    # A freed INTERACTIVE slot still goes to the waiting INTERACTIVE request.
    first[0].future.result().release()
    assert first[2].future.done()


async def test_a_class_cap_keeps_batch_off_slots_interactive_needs() -> None:
    admission = _one_worker(slots=2, batch_cap=1)
    batches = [admission.enqueue(make_request(f"b{i}", sla=SlaClass.BATCH)) for i in range(2)]
    assert [t.future.done() for t in batches] == [True, False]
    assert admission.enqueue(make_request("i0")).future.done(), "the slot BATCH may not take"


async def test_a_full_queue_refuses_with_a_retry_hint_that_grows_with_the_backlog() -> None:
    admission = _one_worker(slots=1, queue_capacity=2, retry_after_ms=250)
    admission.enqueue(make_request("running"))
    admission.enqueue(make_request("w1"))
    admission.enqueue(make_request("w2"))
    with pytest.raises(QueueFull) as refused:
        admission.enqueue(make_request("refused"))
    # Two waiting for one slot: two more rounds of that slot before a place frees.
    assert refused.value.retry_after_ms == 250 * 3
    assert [value for _, value in refused.value.trailing_metadata()] == ["750"]
    # Each class has its own queue: BATCH still has room.
    assert not admission.enqueue(make_request("b", sla=SlaClass.BATCH)).future.done()


async def test_a_withdrawn_request_leaves_its_queue_and_its_place_goes_to_the_next() -> None:
    admission = _one_worker(slots=1, queue_capacity=1)
    holder = admission.enqueue(make_request("holder"))
    gone = admission.enqueue(make_request("gone"))
    admission.withdraw(gone)
    assert admission.depth(SlaClass.INTERACTIVE) == 0
    stays = admission.enqueue(make_request("stays"))  # the place is free again
    holder.future.result().release()
    assert stays.future.done() and gone.future.cancelled()


async def test_no_ready_worker_is_no_worker_available_unless_a_standby_can_be_promoted() -> None:
    registry, _, _ = make_registry()
    make_worker_entry(registry, "starting", ready=False)
    admission = make_admission(registry)
    with pytest.raises(NoWorkerAvailable):
        admission.enqueue(make_request("r0"))

    standby = make_worker_entry(registry, "s0", WorkerRole.STANDBY)
    ticket = admission.enqueue(make_request("r1"))
    assert standby.role == WorkerRole.ACTIVE
    assert ticket.future.result().entry is standby


async def test_a_moving_request_goes_to_the_head_of_its_queue_even_when_it_is_full() -> None:
    registry, _, _ = make_registry()
    make_worker_entry(registry, "w0")
    make_worker_entry(registry, "w1")
    admission = make_admission(registry, make_limits(max_seqs_per_worker=1, queue_capacity=1))
    on_noticed = admission.enqueue(make_request("on-noticed"))
    on_other = admission.enqueue(make_request("on-other"))
    noticed = on_noticed.future.result().entry
    other = on_other.future.result().entry
    registry.set_orchestrated_state(noticed, WorkerState.PREEMPTED)
    waiting = admission.enqueue(make_request("waiting"))  # the queue is full now
    requeued = admission.requeue(on_noticed.request, exclude=frozenset({noticed.address}))
    assert not requeued.future.done() and admission.depth(SlaClass.INTERACTIVE) == 2
    on_other.future.result().release()
    assert requeued.future.done(), "the request that was already admitted goes first"
    assert requeued.future.result().entry is other
    assert not waiting.future.done()


async def test_routing_prefers_the_worker_with_the_most_kv_headroom() -> None:
    registry, _, _ = make_registry()
    make_worker_entry(registry, "tight", kv_blocks_free=10)
    roomy = make_worker_entry(registry, "roomy", kv_blocks_free=900)
    admission = make_admission(registry)
    assert admission.enqueue(make_request("r0")).future.result().entry is roomy
