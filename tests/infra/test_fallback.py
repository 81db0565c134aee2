"""The fallback policy and bounds: how many on-demand workers to ask for, given the spot side."""

from __future__ import annotations

import pytest

from spotinfer.fleet import FleetError
from spotinfer.fleet.fallback import check_fallback_count, fallback_count_wanted


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
