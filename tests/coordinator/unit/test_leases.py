"""Workers that register themselves: leases, their expiry, the partition rule (a worker cut
off gets no new request until it registers again), deregistration, and the fleet's model
fingerprint (a worker with another model is refused)."""

from __future__ import annotations

import grpc
import pytest

from coordinator.errors import ModelMismatch
from coordinator.fleet_model import FleetModel
from coordinator.heartbeat import Heartbeat
from coordinator.registry import Registry, WorkerEntry, WorkerState
from tests.support.clock import ManualClock
from tests.support.factories import (
    FINGERPRINT,
    LEASE_TTL_SECONDS,
    LOST_AFTER_SECONDS,
    Fakes,
    make_registration,
    make_registry,
)
from tests.support.fake_worker import FakeWorker


def _fake(entry: WorkerEntry) -> FakeWorker:
    assert isinstance(entry.client, FakeWorker)
    return entry.client


def _registered(registry: Registry, address: str = "10.0.0.5:50061") -> WorkerEntry:
    entry, known = registry.register(make_registration(address))
    assert not known
    _fake(entry).capacity = entry.capacity  # the fake answers Stats as the worker registered
    return entry


async def test_a_registered_worker_is_routable_at_once_with_its_labels() -> None:
    registry, _, _ = make_registry()
    entry = _registered(registry)
    assert registry.routable() == [entry]
    assert entry.pool.cloud == "aws" and entry.pool.spot
    assert entry.model_fingerprint == FINGERPRINT
    assert entry.lease_left_seconds(registry.now()) == LEASE_TTL_SECONDS


async def test_a_lease_that_runs_out_makes_the_worker_unroutable_though_it_answers() -> None:
    registry, _, clock = make_registry()
    entry = _registered(registry)
    heartbeat = Heartbeat(registry, interval_seconds=1.0)
    clock.advance(LEASE_TTL_SECONDS)
    await heartbeat.beat()
    assert entry.state == WorkerState.READY, "exactly the TTL is still within the lease"
    clock.advance(0.001)
    await heartbeat.beat()
    assert entry.state == WorkerState.LOST and registry.routable() == []


async def test_a_renewal_in_time_keeps_the_worker_routable() -> None:
    registry, _, clock = make_registry()
    entry = _registered(registry)
    heartbeat = Heartbeat(registry, interval_seconds=1.0)
    for _ in range(5):
        clock.advance(LEASE_TTL_SECONDS * 0.75)
        again, known = registry.register(make_registration(entry.address))
        assert known and again is entry
        await heartbeat.beat()
        assert registry.routable() == [entry]


async def test_a_partitioned_worker_gets_no_request_until_it_registers_again() -> None:
    registry, _, clock = make_registry()
    entry = _registered(registry)
    heartbeat = Heartbeat(registry, interval_seconds=1.0)
    _fake(entry).down = True  # the partition: neither heartbeats nor renewals get through
    clock.advance(LOST_AFTER_SECONDS + 0.5)
    await heartbeat.beat()
    assert entry.state == WorkerState.LOST
    _fake(entry).down = False  # healed: the heartbeat answers before the next renewal
    await heartbeat.beat()
    await heartbeat.beat()
    assert entry.state == WorkerState.LOST and registry.routable() == [], (
        "a heartbeat alone does not bring back a leased worker"
    )
    registry.register(make_registration(entry.address))
    assert entry.state == WorkerState.READY and registry.routable() == [entry]


async def test_a_worker_without_a_lease_comes_back_with_its_heartbeat() -> None:
    registry, _, clock = make_registry()
    entry, _ = registry.register(make_registration("w0", lease_ttl_seconds=0.0))
    _fake(entry).capacity = entry.capacity
    heartbeat = Heartbeat(registry, interval_seconds=1.0)
    _fake(entry).down = True
    clock.advance(LOST_AFTER_SECONDS + 1)
    await heartbeat.beat()
    assert entry.state == WorkerState.LOST
    _fake(entry).down = False
    await heartbeat.beat()
    assert entry.state == WorkerState.READY, "the launcher's workers keep the old rule"


async def test_deregistering_stops_the_worker_and_a_new_registration_starts_afresh() -> None:
    registry, _, _ = make_registry()
    entry = _registered(registry)
    assert registry.deregister(entry.address)
    assert entry.state == WorkerState.STOPPED and registry.routable() == []
    assert not registry.deregister(entry.address), "only once"
    again, known = registry.register(make_registration(entry.address))
    assert not known and again is not entry and again.state == WorkerState.READY


async def test_a_worker_with_another_model_is_refused_naming_both_fingerprints() -> None:
    registry, _, _ = make_registry()
    _registered(registry, "w0:1")
    other = "0" * 32
    with pytest.raises(ModelMismatch) as refused:
        registry.register(make_registration("w1:1", fingerprint=other))
    assert refused.value.grpc_code == grpc.StatusCode.FAILED_PRECONDITION
    assert other in str(refused.value) and FINGERPRINT in str(refused.value)
    assert "first worker" in str(refused.value)
    assert [e.address for e in registry] == ["w0:1"], "the refused worker is not registered"


async def test_a_configured_fingerprint_refuses_even_the_first_worker() -> None:
    clock = ManualClock()
    fakes = Fakes()
    registry = Registry(LOST_AFTER_SECONDS, fakes.client, clock, FleetModel("a" * 32))
    with pytest.raises(ModelMismatch, match="--model-fingerprint"):
        registry.register(make_registration("w0:1"))
    registry.register(make_registration("w0:1", fingerprint="a" * 32))
    assert registry.fleet_model.fingerprint == "a" * 32


async def test_the_fleet_takes_the_first_registered_model_for_its_tokenizer() -> None:
    registry, _, _ = make_registry()
    assert registry.fleet_model.model == ""
    registry.register(make_registration("w0:1", model="/models/tiny"))
    registry.register(make_registration("w1:1", model="/models/elsewhere/tiny"))
    assert registry.fleet_model.model == "/models/tiny"


async def test_a_restarted_coordinator_learns_the_fleet_from_renewals() -> None:
    """A new registry (a restart, or a replica) knows nobody until the renewals come; each
    renewal registers its worker, fixing the fingerprint from the first."""
    registry, _, _ = make_registry()
    assert list(registry) == []
    for address in ("w0:1", "w1:1", "w2:1"):
        registry.register(make_registration(address))
    assert sorted(e.address for e in registry.routable()) == ["w0:1", "w1:1", "w2:1"]
    assert registry.fleet_model.fingerprint == FINGERPRINT
