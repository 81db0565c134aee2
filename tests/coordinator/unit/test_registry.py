"""The registry and heartbeat in-process, on a manual clock: who is routable, when a silent
worker is LOST (and not a moment before), standbys, draining, and state-change listeners."""

from __future__ import annotations

from coordinator.heartbeat import Heartbeat
from coordinator.registry import Registry, WorkerEntry, WorkerRole, WorkerState
from tests.support.factories import (
    LOST_AFTER_SECONDS,
    make_capacity,
    make_registry,
    make_worker_entry,
)
from tests.support.fake_worker import FakeWorker


def _fake(entry: WorkerEntry) -> FakeWorker:
    assert isinstance(entry.client, FakeWorker)
    return entry.client


def _changes(registry: Registry) -> list[tuple[str, str, str]]:
    seen: list[tuple[str, str, str]] = []
    registry.subscribe(lambda e, old, new: seen.append((e.address, old.value, new.value)))
    return seen


async def test_a_registered_worker_is_routable_once_its_heartbeat_says_ready() -> None:
    registry, _, _ = make_registry()
    entry, known = registry.add("w0", WorkerRole.ACTIVE)
    assert not known and entry.state == WorkerState.STARTING and registry.routable() == []
    changes = _changes(registry)
    heartbeat = Heartbeat(registry, interval_seconds=1.0)
    _fake(entry).capacity = make_capacity("worker-zero", ready=False)
    await heartbeat.beat()
    assert entry.state == WorkerState.STARTING and registry.routable() == []
    _fake(entry).capacity = make_capacity("worker-zero")
    await heartbeat.beat()
    assert registry.routable() == [entry]
    assert entry.worker_id == "worker-zero", "the worker's own id replaces its address"
    assert changes == [("w0", "starting", "ready")]
    assert registry.find("worker-zero") is entry and registry.find("w0") is entry


async def test_registering_again_keeps_the_entry_and_takes_the_new_role() -> None:
    registry, fakes, _ = make_registry()
    entry = make_worker_entry(registry, "w0", WorkerRole.STANDBY)
    again, known = registry.add("w0", WorkerRole.ACTIVE, daemon_address="d0:1")
    assert known and again is entry
    assert entry.role == WorkerRole.ACTIVE and entry.daemon_address == "d0:1"
    assert len(fakes.workers) == 1, "no second channel to the same worker"


async def test_a_silent_worker_is_lost_after_the_timeout_not_before() -> None:
    registry, _, clock = make_registry()
    entry = make_worker_entry(registry, "w0")
    _fake(entry).down = True
    heartbeat = Heartbeat(registry, interval_seconds=1.0)
    clock.advance(LOST_AFTER_SECONDS)  # silent exactly as long as allowed
    await heartbeat.beat()
    assert entry.state == WorkerState.READY and registry.routable() == [entry]
    clock.advance(0.001)
    await heartbeat.beat()
    assert entry.state == WorkerState.LOST and registry.routable() == []


async def test_a_lost_worker_that_answers_again_is_ready_again() -> None:
    registry, _, clock = make_registry()
    entry = make_worker_entry(registry, "w0")
    changes = _changes(registry)
    _fake(entry).down = True
    clock.advance(LOST_AFTER_SECONDS + 1)
    heartbeat = Heartbeat(registry, interval_seconds=1.0)
    await heartbeat.beat()
    _fake(entry).down = False
    await heartbeat.beat()
    assert entry.state == WorkerState.READY
    assert changes == [("w0", "ready", "lost"), ("w0", "lost", "ready")]


async def test_a_draining_worker_takes_no_new_request() -> None:
    registry, _, _ = make_registry()
    says_so = make_worker_entry(registry, "w0", draining=True)
    asked = make_worker_entry(registry, "w1")
    registry.request_drain(asked)
    assert says_so.state == WorkerState.DRAINING and asked.state == WorkerState.DRAINING
    assert registry.routable() == []


async def test_a_standby_is_not_routable_until_promoted() -> None:
    registry, _, _ = make_registry()
    active = make_worker_entry(registry, "w0")
    standby = make_worker_entry(registry, "s0", WorkerRole.STANDBY)
    assert registry.routable() == [active] and registry.ready_standbys() == [standby]
    registry.promote(standby)
    assert registry.routable() == [active, standby] and registry.ready_standbys() == []


async def test_a_suspect_worker_is_cleared_only_by_a_heartbeat_asked_after_the_break() -> None:
    registry, _, clock = make_registry()
    entry = make_worker_entry(registry, "w0")
    asked_before = clock()
    clock.advance(0.5)
    registry.suspect(entry)
    registry.record_heartbeat(entry, make_capacity("w0"), asked_before)
    assert entry.suspect_since_monotonic is not None, "an answer from before the break"
    clock.advance(0.5)
    registry.record_heartbeat(entry, make_capacity("w0"), clock())
    assert entry.suspect_since_monotonic is None


async def test_orchestrated_states_outlast_heartbeats_and_stopped_is_final() -> None:
    registry, _, clock = make_registry()
    entry = make_worker_entry(registry, "w0")
    registry.set_orchestrated_state(entry, WorkerState.PREEMPTED)
    registry.record_heartbeat(entry, make_capacity("w0"), clock())
    registry.refresh()
    assert entry.state == WorkerState.PREEMPTED and registry.routable() == []
    registry.set_orchestrated_state(entry, WorkerState.STOPPED)
    clock.advance(LOST_AFTER_SECONDS * 10)
    registry.refresh()
    assert entry.state == WorkerState.STOPPED, "not LOST: it was stopped on purpose"
    again, known = registry.add("w0", WorkerRole.ACTIVE)
    assert not known and again is not entry, "a stopped worker registers afresh"


async def test_max_model_len_is_what_every_ready_worker_can_serve() -> None:
    registry, _, _ = make_registry()
    assert registry.max_model_len() == 0
    make_worker_entry(registry, "w0", max_model_len=2048)
    make_worker_entry(registry, "s0", WorkerRole.STANDBY, max_model_len=1024)
    make_worker_entry(registry, "starting", ready=False, max_model_len=512)
    assert registry.max_model_len() == 1024


async def test_a_worker_that_cannot_reach_its_store_takes_no_new_request_until_it_can() -> None:
    registry, _, _ = make_registry()
    entry = make_worker_entry(registry, "w0")
    changes = _changes(registry)
    heartbeat = Heartbeat(registry, interval_seconds=1.0)
    _fake(entry).capacity = make_capacity("w0", degraded=True)
    await heartbeat.beat()
    assert entry.state == WorkerState.DEGRADED and registry.routable() == []
    _fake(entry).capacity = make_capacity("w0")
    await heartbeat.beat()
    assert registry.routable() == [entry]
    assert changes == [("w0", "ready", "degraded"), ("w0", "degraded", "ready")]
