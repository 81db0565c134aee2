"""The drills' local clusters: each test starts its own (scenarios destroy what they touch)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from spotinfer.local.cluster import ClusterConfig, LocalCluster


@pytest.fixture
def cluster_factory(tiny_model: Path, tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    """``make(**overrides)`` starts a small cluster on the tiny model (ClusterConfig fields
    override the defaults); every cluster made is stopped after the test."""
    clusters: list[LocalCluster] = []

    def make(**overrides: object) -> LocalCluster:
        fields: dict[str, object] = {
            "model": str(tiny_model),
            "workers": 1,
            "standbys": 1,
            "dtype": "float32",
            "max_model_len": 1024,
            "memory_gib": 0.25,
            "log_dir": tmp_path / "logs",
            "coordinator_flags": ("--record-retention-seconds", "1"),
        }
        fields.update(overrides)
        cluster = LocalCluster(ClusterConfig(**fields)).start()  # type: ignore[arg-type]
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()
