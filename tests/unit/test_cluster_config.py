"""The local cluster's configuration refuses what it cannot honour, with a readable message."""

from __future__ import annotations

import pytest

from spotinfer.local.cluster import ClusterConfig


def test_gcp_notice_length_sets_the_grace() -> None:
    assert ClusterConfig(model="m", cloud="gcp").grace_seconds == 30.0
    config = ClusterConfig(model="m", cloud="gcp", notice_seconds=6.0)
    assert config.grace_seconds == 6.0
    assert not config.notice_has_deadline
    assert ClusterConfig(model="m", cloud="aws").notice_has_deadline


@pytest.mark.parametrize("cloud", ["aws", "azure"])
def test_a_notice_length_is_refused_where_the_notice_carries_its_deadline(cloud: str) -> None:
    with pytest.raises(ValueError, match="carry their own deadline"):
        ClusterConfig(model="m", cloud=cloud, notice_seconds=6.0)


@pytest.mark.parametrize("seconds", [-1.0, 121.0])
def test_a_notice_length_outside_gcps_range_is_refused(seconds: float) -> None:
    with pytest.raises(ValueError, match=r"notice_seconds must be in \(0, 120\]"):
        ClusterConfig(model="m", cloud="gcp", notice_seconds=seconds)


@pytest.mark.parametrize("masters", [-1, 1, 2])
def test_a_redis_cluster_of_fewer_than_three_masters_is_refused(masters: int) -> None:
    with pytest.raises(ValueError, match="0 \\(one redis-server\\) or at least 3"):
        ClusterConfig(model="m", redis_cluster_masters=masters)


def test_a_redis_cluster_of_our_own_does_not_go_with_an_outside_redis() -> None:
    assert ClusterConfig(model="m", redis_cluster_masters=3).redis_cluster_masters == 3
    with pytest.raises(ValueError, match="cannot go with --redis-url"):
        ClusterConfig(model="m", redis_cluster_masters=3, redis_url="redis://10.0.0.1:6379/0")
