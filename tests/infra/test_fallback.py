"""The fallback policy and bounds: how many on-demand workers to ask for, given the spot side,
and its rounds against a fleet."""

from __future__ import annotations

import threading

import pytest

from spotinfer.fleet import (
    FleetError,
    FleetInstance,
    GcpFleet,
    GcpFleetConfig,
    InstanceState,
    Lifecycle,
)
from spotinfer.fleet.constants import (
    FALLBACK_TIER,
    FLEET_LABEL_KEY,
    ROLE_LABEL_KEY,
    TIER_LABEL_KEY,
)
from spotinfer.fleet.fallback import (
    FallbackDecision,
    autoscale_fallback,
    autoscale_rounds,
    check_fallback_count,
    fallback_count_wanted,
    spot_ready_count,
)
from tests.infra.fake_compute import FakeCompute, FakeInstance


@pytest.mark.parametrize(
    ("spot_wanted", "spot_ready", "fallback_count", "fallback_max", "expected"),
    [
        (4, 4, 0, 3, 0),  # spot holds the load: no fallback
        (4, 2, 0, 3, 2),  # two spot workers short: two on demand
        (4, 0, 0, 3, 3),  # short by four, capped at the group's maximum
        (4, 3, 2, 3, 2),  # spot partly back: keep what runs, release it once spot is whole
        (4, 1, 2, 3, 3),  # shortfall grew: grow with it
        (4, 4, 3, 3, 0),  # spot back at wanted: release every fallback worker
        (4, 5, 1, 3, 0),  # more spot ready than wanted (a replacement launched early)
        (4, 0, 0, 0, 0),  # a fleet without a fallback group asks for none
        (4, 3, 5, 2, 2),  # the maximum was lowered under the current count
    ],
)
def test_fallback_covers_the_spot_shortfall_until_spot_is_back(
    spot_wanted: int, spot_ready: int, fallback_count: int, fallback_max: int, expected: int
) -> None:
    assert fallback_count_wanted(spot_wanted, spot_ready, fallback_count, fallback_max) == expected


def test_a_spot_outage_and_its_recovery_grow_then_release_the_fallback() -> None:
    fallback = 0
    seen = []
    for spot_ready in (4, 3, 1, 0, 2, 3, 4, 4):
        fallback = fallback_count_wanted(4, spot_ready, fallback, fallback_max=3)
        seen.append(fallback)
    assert seen == [0, 1, 3, 3, 3, 3, 0, 0]


def test_negative_inputs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="spot_ready"):
        fallback_count_wanted(4, -1, 0, 3)


@pytest.mark.parametrize(
    ("count", "message"),
    [(-2, "must not be negative, got -2"), (5, "above the fallback group's maximum of 4")],
)
def test_counts_outside_the_group_are_fleet_errors(count: int, message: str) -> None:
    with pytest.raises(FleetError, match=message):
        check_fallback_count(count, max_count=4)
    check_fallback_count(0, max_count=4)
    check_fallback_count(4, max_count=4)


# ---- one round against a fleet, and rounds in a loop (GCP adapter on the local Compute) -------


def _worker(
    name: str,
    state: InstanceState = InstanceState.RUNNING,
    lifecycle: Lifecycle = Lifecycle.SPOT,
    is_fallback: bool = False,
) -> FleetInstance:
    return FleetInstance(name, "zone-a", state, lifecycle, "g6.xlarge", is_fallback=is_fallback)


def test_spot_ready_counts_running_members_of_the_spot_group_only() -> None:
    workers = [
        _worker("spot-a"),
        _worker("base-b", lifecycle=Lifecycle.ON_DEMAND),  # the spot group's on-demand base
        _worker("noticed-c", state=InstanceState.STOPPING),
        _worker("booting-d", state=InstanceState.PROVISIONING),
        _worker("fallback-e", lifecycle=Lifecycle.ON_DEMAND, is_fallback=True),
    ]
    assert spot_ready_count(workers) == 2


def _labels(tier: str | None = None) -> dict[str, str]:
    labels = {FLEET_LABEL_KEY: "demo", ROLE_LABEL_KEY: "worker"}
    return {**labels, TIER_LABEL_KEY: tier} if tier else labels


def _fleet(
    compute: FakeCompute, spot_wanted: int, spot_running: int, fallback: int, max_count: int
) -> GcpFleet:
    """The spot group asks for ``spot_wanted`` and runs ``spot_running``; the fallback group
    runs ``fallback`` on-demand VMs, labelled with its tier."""
    compute.target_size = spot_wanted
    compute.other_groups["demo-fallback"] = fallback
    for index in range(spot_wanted):
        status = "RUNNING" if index < spot_running else "STOPPING"
        compute.add(FakeInstance(f"demo-spot-{index}", "us-central1-a", status, _labels()))
    for index in range(fallback):
        compute.add(
            FakeInstance(
                f"demo-fallback-{index}",
                "us-central1-b",
                labels=_labels(FALLBACK_TIER),
                provisioning_model="STANDARD",
            )
        )
    config = GcpFleetConfig(
        fleet_name="demo",
        region="us-central1",
        project="spot-project",
        fallback_max_count=max_count,
        endpoint_url=compute.url,
    )
    return GcpFleet.connect(config)


def _resizes(compute: FakeCompute) -> list[str]:
    return [request.path for request in compute.requests if request.path.endswith("/resize")]


@pytest.mark.parametrize(
    ("spot_running", "expected"),
    [(3, 1), (0, 2)],  # one short: one on demand; four short: capped at the maximum of 2
)
def test_a_spot_shortfall_grows_the_fallback_to_cover_it(
    fake_compute: FakeCompute, spot_running: int, expected: int
) -> None:
    fleet = _fleet(fake_compute, spot_wanted=4, spot_running=spot_running, fallback=0, max_count=2)

    decision = autoscale_fallback(fleet)

    assert fake_compute.other_groups["demo-fallback"] == expected
    assert fake_compute.target_size == 4  # the spot group is left to itself
    assert (decision.spot_wanted, decision.spot_ready) == (4, spot_running)
    assert (decision.count_before, decision.count_after, decision.changed) == (0, expected, True)
    assert f"0 → {expected}" in decision.describe()


def test_spot_back_releases_every_fallback_worker(fake_compute: FakeCompute) -> None:
    # Four spot VMs and two running fallback VMs: the fallback ones are not counted as spot.
    fleet = _fleet(fake_compute, spot_wanted=4, spot_running=4, fallback=2, max_count=3)

    decision = autoscale_fallback(fleet)

    assert decision.spot_ready == 4
    assert fake_compute.other_groups["demo-fallback"] == 0
    assert decision.reason == "spot holds the load"


@pytest.mark.parametrize(
    ("spot_running", "fallback"),
    [(4, 0), (2, 2), (3, 2)],  # whole; short and covered; partly back, kept until whole
)
def test_an_unchanged_answer_resizes_nothing(
    fake_compute: FakeCompute, spot_running: int, fallback: int
) -> None:
    fleet = _fleet(
        fake_compute, spot_wanted=4, spot_running=spot_running, fallback=fallback, max_count=3
    )

    decision = autoscale_fallback(fleet)

    assert not decision.changed
    assert _resizes(fake_compute) == []
    assert "stays at" in decision.describe()


def test_a_failed_round_is_yielded_and_the_next_round_runs(fake_compute: FakeCompute) -> None:
    fleet = _fleet(fake_compute, spot_wanted=4, spot_running=2, fallback=0, max_count=3)
    stop = threading.Event()
    outcomes: list[FallbackDecision | FleetError] = []

    for outcome in autoscale_rounds(fleet, every_seconds=0.01, stop=stop):
        outcomes.append(outcome)
        if len(outcomes) == 1:
            del fake_compute.other_groups["demo-fallback"]  # the next round's reads fail
        elif len(outcomes) == 2:
            fake_compute.other_groups["demo-fallback"] = 2
            fake_compute.instances["demo-spot-2"].status = "RUNNING"
            fake_compute.instances["demo-spot-3"].status = "RUNNING"
        else:
            stop.set()

    first, failed, last = outcomes
    assert isinstance(first, FallbackDecision) and first.count_after == 2
    assert isinstance(failed, FleetError) and "no fallback group demo-fallback" in str(failed)
    assert isinstance(last, FallbackDecision) and (last.count_before, last.count_after) == (2, 0)
    assert fake_compute.other_groups["demo-fallback"] == 0


def test_rounds_need_a_positive_interval(fake_compute: FakeCompute) -> None:
    fleet = _fleet(fake_compute, spot_wanted=1, spot_running=1, fallback=0, max_count=1)
    with pytest.raises(ValueError, match="every_seconds must be positive"):
        next(autoscale_rounds(fleet, every_seconds=0, stop=threading.Event()))
