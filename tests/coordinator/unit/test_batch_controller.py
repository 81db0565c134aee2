"""The adaptive workload-batch controller on a manual clock, no process: it shrinks a
worker's batch when the INTERACTIVE class decodes too slowly (BATCH first), grows it while
requests wait and the decode has headroom, holds inside its hysteresis band and while a
change settles, stays within its bounds, and admission follows its caps."""

from __future__ import annotations

from common.requests import SlaClass
from coordinator.batch_controller import BatchController, BatchControllerConfig, Decision
from coordinator.registry import Registry, WorkerEntry
from tests.support.clock import ManualClock
from tests.support.factories import (
    make_admission,
    make_limits,
    make_registry,
    make_request,
    make_worker_entry,
)

INTER, BATCH = SlaClass.INTERACTIVE, SlaClass.BATCH
CONFIG = BatchControllerConfig(
    enabled=True,
    interval_seconds=0.5,
    window_seconds=5.0,
    settle_seconds=1.0,
    interactive_ttft_slo_ms=2000.0,
    interactive_tpot_slo_ms=100.0,
    grow_step=4,
    shrink_factor=0.5,
    headroom=0.8,
    min_cap=2,
    min_tokens=8,
)


def _setup(
    max_num_seqs: int = 64, interactive: int = 16, batch: int = 32
) -> tuple[BatchController, WorkerEntry, ManualClock, Registry, list[Decision]]:
    registry, _, clock = make_registry()
    entry = make_worker_entry(registry, "w0", max_num_seqs=max_num_seqs)
    decisions: list[Decision] = []
    controller = BatchController(
        CONFIG, {INTER: interactive, BATCH: batch}, clock, on_decision=decisions.append
    )
    return controller, entry, clock, registry, decisions


def _decode(
    controller: BatchController,
    clock: ManualClock,
    tpot: float,
    steps: int = 10,
    sla: SlaClass = INTER,
) -> None:
    """Two streams decoding one token per step, each step ``tpot`` long."""
    for rid in ("a", "b"):
        controller.first_token("w0", sla, rid, 0.1)
    for _ in range(steps):
        clock.advance(tpot)
        for rid in ("a", "b"):
            controller.tokens("w0", sla, rid, 1)


def _tick(
    controller: BatchController,
    entry: WorkerEntry,
    waiting: dict[SlaClass, int] | None = None,
    oldest_wait: float = 0.0,
) -> list[Decision]:
    return controller.tick([entry], waiting or {}, oldest_wait)


def test_the_tuners_caps_are_the_start_bounded_by_max_num_seqs() -> None:
    controller, entry, *_ = _setup(max_num_seqs=24, interactive=16, batch=0)
    assert controller.cap(entry, INTER) == 16
    assert controller.cap(entry, BATCH) == 24, "no static cap: the worker's max_num_seqs"


def test_a_slow_decode_shrinks_batch_first_then_interactive() -> None:
    controller, entry, clock, _, decisions = _setup()
    entry.in_flight[BATCH] = 12  # of a cap of 32: the cut is from what runs
    _decode(controller, clock, tpot=0.15)
    assert _tick(controller, entry) == [decisions[0]]
    assert (decisions[0].sla_class, decisions[0].decision) == (BATCH, "shrink")
    assert controller.cap(entry, BATCH) == 6 and controller.cap(entry, INTER) == 16
    assert "TPOT over 100 ms" in decisions[0].reason

    entry.in_flight[BATCH] = 0  # no BATCH runs there any more: INTERACTIVE's own batch shrinks
    clock.advance(1.0)
    _decode(controller, clock, tpot=0.15)
    _tick(controller, entry)
    assert controller.cap(entry, INTER) == 8 and decisions[-1].sla_class == INTER


def test_a_change_settles_before_the_next_and_forgets_the_old_window() -> None:
    controller, entry, clock, _, decisions = _setup()
    _decode(controller, clock, tpot=0.15, steps=20)
    _tick(controller, entry)
    assert controller.cap(entry, INTER) == 8
    # The old window is gone: past settle_seconds with nothing new, nothing to act on.
    clock.advance(1.5)
    assert _tick(controller, entry) == []
    assert controller.signals_of(entry).tpot is None
    assert len(decisions) == 1


def test_inside_settle_seconds_only_a_long_interactive_queue_changes_a_cap() -> None:
    controller, entry, clock, _, decisions = _setup()
    _decode(controller, clock, tpot=0.15, steps=20)
    _tick(controller, entry)
    assert len(decisions) == 1
    _decode(controller, clock, tpot=0.09)  # 0.9 s: still too slow, and a request waits
    assert _tick(controller, entry, {INTER: 9}, oldest_wait=0.3) == []
    # A queue is measured now, not over the window: a long one grows the cap at once.
    assert [d.decision for d in _tick(controller, entry, {INTER: 9}, oldest_wait=0.6)] == ["grow"]
    assert controller.cap(entry, INTER) == 17
    clock.advance(1.0)
    _decode(controller, clock, tpot=0.15)
    # Settled: what the new cap produced (too slow) shrinks it again.
    assert [d.decision for d in _tick(controller, entry)] == ["shrink"]
    assert controller.cap(entry, INTER) == 8


def test_queued_interactive_requests_past_their_ttft_grow_the_cap_while_tpot_has_room() -> None:
    controller, entry, clock, _, decisions = _setup(interactive=16)
    _decode(controller, clock, tpot=0.05)
    _tick(controller, entry, {INTER: 5}, oldest_wait=2.5)
    assert controller.cap(entry, INTER) == 21, "grown by what waits (5 > grow_step 4)"
    assert decisions[-1].decision == "grow" and "5 INTERACTIVE waiting" in decisions[-1].reason
    # Additive steps up to the worker's max_num_seqs, never beyond it.
    for _ in range(20):
        clock.advance(1.0)
        _decode(controller, clock, tpot=0.05)
        _tick(controller, entry, {INTER: 5}, oldest_wait=2.5)
    assert controller.cap(entry, INTER) == 64


def test_overload_grows_interactive_once_its_requests_queue_past_part_of_their_ttft() -> None:
    controller, entry, clock, _, decisions = _setup()
    _decode(controller, clock, tpot=0.3)  # over the TPOT target, and requests wait
    # Not long yet: a smaller batch would only queue them past their TTFT; a larger one
    # would slow the decode further. It holds.
    assert _tick(controller, entry, {INTER: 6}, oldest_wait=0.3) == []
    caps = controller.caps_of(entry)
    assert caps[INTER].cap == 16 and caps[INTER].reason.endswith("overloaded")
    # Queued past a quarter of the TTFT target: a certain TTFT miss outweighs a slower decode, so
    # INTERACTIVE grows by what waits, TPOT over target or not.
    assert [(d.sla_class, d.decision) for d in _tick(controller, entry, {INTER: 6}, 1.5)] == [
        (INTER, "grow")
    ]
    assert controller.cap(entry, INTER) == 22
    assert "the oldest 1500 ms" in decisions[-1].reason
    # BATCH work running there is shrunk before INTERACTIVE grows.
    clock.advance(1.0)
    _decode(controller, clock, tpot=0.3)
    entry.in_flight[BATCH] = 4
    assert [(d.sla_class, d.decision) for d in _tick(controller, entry, {INTER: 6}, 3.0)] == [
        (BATCH, "shrink")
    ]
    # With nothing INTERACTIVE waiting, a slow decode shrinks INTERACTIVE from what runs.
    clock.advance(1.0)
    _decode(controller, clock, tpot=0.3)
    entry.in_flight[BATCH], entry.in_flight[INTER] = 0, 20
    assert [(d.sla_class, d.decision) for d in _tick(controller, entry)] == [(INTER, "shrink")]
    assert controller.cap(entry, INTER) == 10


def test_tpot_inside_the_hysteresis_band_holds() -> None:
    controller, entry, clock, _, decisions = _setup()
    _decode(controller, clock, tpot=0.09)  # over 0.8 x 100 ms, under 100 ms
    assert _tick(controller, entry, {INTER: 5, BATCH: 5}, oldest_wait=0.3) == []
    caps = controller.caps_of(entry)
    assert (caps[INTER].cap, caps[INTER].decision) == (16, "hold")
    assert "hysteresis band" in caps[INTER].reason
    assert not decisions


def test_batch_grows_only_while_interactive_meets_its_slo_and_waits_for_nothing() -> None:
    controller, entry, clock, _, _ = _setup(batch=8)
    _decode(controller, clock, tpot=0.05)
    _tick(controller, entry, {BATCH: 10, INTER: 2}, oldest_wait=0.5)
    assert controller.cap(entry, BATCH) == 8, "INTERACTIVE waits: its cap grows, not BATCH's"
    assert controller.cap(entry, INTER) == 20
    clock.advance(1.0)
    _decode(controller, clock, tpot=0.05)
    _tick(controller, entry, {BATCH: 10}, oldest_wait=0.0)
    assert controller.cap(entry, BATCH) == 12
    clock.advance(1.0)
    _decode(controller, clock, tpot=0.05)
    # A first token over the TTFT target (no INTERACTIVE queued): BATCH does not grow.
    controller.first_token("w0", INTER, "late", 2.5)
    _tick(controller, entry, {BATCH: 10}, oldest_wait=0.0)
    assert controller.cap(entry, BATCH) == 12


def test_the_floor_holds_a_shrink() -> None:
    controller, entry, clock, _, _ = _setup(interactive=2, batch=2)
    _decode(controller, clock, tpot=0.5)
    assert _tick(controller, entry) == []
    assert controller.caps_of(entry)[INTER].reason.endswith("INTERACTIVE already at its floor")


def test_no_measurement_and_nothing_waiting_holds() -> None:
    controller, entry, _, _, _ = _setup()
    assert _tick(controller, entry) == []
    assert controller.signals_of(entry).tpot is None


def test_batch_streams_do_not_count_as_interactive_decode() -> None:
    controller, entry, clock, _, _ = _setup()
    controller.cap(entry, INTER)  # the worker is known
    _decode(controller, clock, tpot=0.5, sla=BATCH)
    assert _tick(controller, entry) == []
    assert controller.signals_of(entry).tpot is None


async def test_admission_follows_the_controllers_caps_and_pumps_when_they_grow() -> None:
    registry, _, clock = make_registry()
    make_worker_entry(registry, "w0", max_num_seqs=8)
    admission = make_admission(registry, make_limits())
    controller = BatchController(CONFIG, {INTER: 2, BATCH: 2}, clock, on_grow=admission.pump)
    admission.use_caps(controller)
    tickets = [admission.enqueue(make_request(f"r{i}")) for i in range(4)]
    assert [t.future.done() for t in tickets] == [True, True, False, False]
    assert admission.class_cap(registry.find("w0"), INTER) == 2
    clock.advance(2.5)
    assert admission.oldest_wait_seconds(INTER) == 2.5
    controller.tick(
        registry.routable(), {INTER: admission.depth(INTER)}, admission.oldest_wait_seconds(INTER)
    )
    assert controller.cap(registry.find("w0"), INTER) == 6
    assert all(t.future.done() for t in tickets), "the grown cap placed the waiting requests"


async def test_the_loop_exports_its_decisions_and_status_views() -> None:
    from coordinator.batch_control_loop import BatchControlLoop
    from coordinator.metrics import CoordinatorMetrics

    registry, _, clock = make_registry()
    entry = make_worker_entry(registry, "w0", max_num_seqs=8)
    admission = make_admission(registry, make_limits(interactive_cap=2))
    metrics = CoordinatorMetrics()
    static = BatchControlLoop(None, 0.5, registry, admission, metrics)
    assert [(v.cap, v.decision) for v in static.views(entry)] == [(2, "static"), (0, "static")]

    controller = BatchController(CONFIG, {INTER: 2}, clock, on_grow=admission.pump)
    admission.use_caps(controller)
    loop = BatchControlLoop(controller, 0.5, registry, admission, metrics)
    tickets = [admission.enqueue(make_request(f"r{i}")) for i in range(3)]
    clock.advance(3.0)
    assert [d.new_cap for d in loop.round()] == [6]
    assert tickets[2].future.done()
    views = {v.sla_class: v for v in loop.views(entry)}
    assert (views[INTER].cap, views[INTER].decision) == (6, "grow")
    assert views[INTER].ttft_p99_seconds == 3.0, "the oldest queued wait counts as a TTFT"
    text = metrics.exposition().decode()
    assert 'spotinfer_coordinator_admission_cap{sla_class="INTERACTIVE",worker="w0"} 6.0' in text
    assert (
        'spotinfer_coordinator_batch_controller_decisions_total{decision="grow",'
        'sla_class="INTERACTIVE"} 1.0'
    ) in text
