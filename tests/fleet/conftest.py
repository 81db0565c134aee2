"""Fixtures of the rehearsal tests: they need root and `ip netns`, and skip with the reason
where either is missing."""

from __future__ import annotations

import pytest

from spotinfer.rehearsal.netns import sweep_leftovers, unavailable_reason


@pytest.fixture(scope="session")
def namespaces() -> None:
    """Skips the test where network namespaces cannot be made; sweeps what a killed
    earlier run left."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"rehearsal needs network namespaces: {reason}")
    sweep_leftovers()
