"""Pools in admission: the on-demand fallback takes only what the other workers cannot, and
a request leaving a noticed worker goes outside its pool first."""

from __future__ import annotations

from common.messages import PoolLabels
from coordinator.admission import Admission
from coordinator.registry import Registry, WorkerEntry, WorkerRole
from coordinator.standby_pool import StandbyPool
from tests.support.factories import (
    make_admission,
    make_limits,
    make_registry,
    make_request,
    make_worker_entry,
)

ZONE_A = PoolLabels(cloud="aws", zone="us-east-1a", instance_type="g5.xlarge", spot=True)
ZONE_B = PoolLabels(cloud="aws", zone="us-east-1b", instance_type="g5.xlarge", spot=True)
FALLBACK = PoolLabels(cloud="aws", zone="us-east-1a", instance_type="g5.xlarge", spot=False)


def labelled(
    registry: Registry, name: str, pool: PoolLabels, role: WorkerRole = WorkerRole.ACTIVE
) -> WorkerEntry:
    entry = make_worker_entry(registry, name, role)
    entry.pool = pool
    return entry


def admission_of(registry: Registry, slots: int = 1, standbys_wanted: int = 0) -> Admission:
    return make_admission(
        registry, make_limits(max_seqs_per_worker=slots), standbys_wanted=standbys_wanted
    )


def worker_of(admission: Admission, request_id: str) -> str:
    ticket = admission.enqueue(make_request(request_id))
    assert ticket.future.done(), f"{request_id} was placed"
    return ticket.future.result().entry.worker_id


async def test_the_fallback_takes_new_requests_only_while_the_spot_workers_are_full() -> None:
    registry, _, _ = make_registry()
    labelled(registry, "fallback", FALLBACK)
    labelled(registry, "spot", ZONE_A)
    admission = admission_of(registry, slots=1)
    first = admission.enqueue(make_request("r0"))
    assert first.future.result().entry.worker_id == "spot"
    assert worker_of(admission, "r1") == "fallback", "the spot worker is full"
    first.future.result().release()
    assert worker_of(admission, "r2") == "spot", "spot has room again: the fallback is spared"


async def test_a_spot_standby_is_promoted_before_the_fallback_is_used() -> None:
    registry, _, _ = make_registry()
    labelled(registry, "fallback", FALLBACK)
    labelled(registry, "standby", ZONE_B, WorkerRole.STANDBY)
    admission = admission_of(registry)
    assert worker_of(admission, "r0") == "standby"
    assert registry.find("standby").role == WorkerRole.ACTIVE


async def test_a_moving_request_goes_outside_its_pool_then_to_the_fallback_then_home() -> None:
    registry, _, _ = make_registry()
    noticed = labelled(registry, "noticed", ZONE_A)
    labelled(registry, "same-zone", ZONE_A)
    labelled(registry, "fallback", FALLBACK)
    labelled(registry, "other-zone", ZONE_B)
    admission = admission_of(registry, slots=1)
    exclude = frozenset({noticed.address})

    def target(request_id: str) -> str:
        lease = admission.reserve(make_request(request_id), exclude, noticed.pool)
        assert lease is not None
        return lease.entry.worker_id

    assert [target("m0"), target("m1"), target("m2")] == ["other-zone", "fallback", "same-zone"]
    assert admission.reserve(make_request("m3"), exclude, noticed.pool) is None


async def test_a_standby_outside_the_pool_is_promoted_before_a_same_pool_worker_is_used() -> None:
    registry, _, _ = make_registry()
    noticed = labelled(registry, "noticed", ZONE_A)
    labelled(registry, "same-zone", ZONE_A)
    labelled(registry, "standby-b", ZONE_B, WorkerRole.STANDBY)
    admission = admission_of(registry)
    lease = admission.place_elsewhere(
        make_request("lost"), frozenset({noticed.address}), noticed.pool
    )
    assert lease is not None and lease.entry.worker_id == "standby-b"


def test_the_standby_promoted_comes_from_the_pool_with_the_most() -> None:
    registry, _, _ = make_registry()
    labelled(registry, "a0", ZONE_A, WorkerRole.STANDBY)
    labelled(registry, "b0", ZONE_B, WorkerRole.STANDBY)
    labelled(registry, "b1", ZONE_B, WorkerRole.STANDBY)
    pool = StandbyPool(registry, wanted=3)
    first = pool.promote_one()
    assert first is not None and first.pool == ZONE_B, "zone B had two"
    second = pool.promote_one()
    assert second is not None and second.pool == ZONE_A, "one of each zone, not both of B"


def test_pool_labels_name_their_pool_and_say_which_is_the_fallback() -> None:
    assert ZONE_A.name == "aws/us-east-1a/g5.xlarge/spot" and not ZONE_A.fallback
    assert FALLBACK.name == "aws/us-east-1a/g5.xlarge/on-demand" and FALLBACK.fallback
    assert PoolLabels().name == "" and not PoolLabels().fallback, "unlabelled: ordinary"


async def test_within_the_noticed_pool_an_idle_standby_goes_before_a_busy_peer() -> None:
    """The peer's notice may be a moment behind in a wave: its requests would move again."""
    registry, _, _ = make_registry()
    noticed = labelled(registry, "noticed", ZONE_A)
    labelled(registry, "peer", ZONE_A)
    labelled(registry, "standby", ZONE_A, WorkerRole.STANDBY)
    admission = admission_of(registry, slots=4)
    lease = admission.reserve(make_request("m0"), frozenset({noticed.address}), noticed.pool)
    assert lease is not None and lease.entry.worker_id == "standby"
    lease = admission.reserve(make_request("m1"), frozenset({noticed.address}), noticed.pool)
    assert lease is not None and lease.entry.worker_id in {"standby", "peer"}
