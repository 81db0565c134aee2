"""The notice and abrupt drills with the store as a 3-master Redis Cluster, started by the
local cluster from its config (``redis_cluster_masters``): every process is given one node
and --redis-cluster, as in a deployment. The verdict checks are test_scenarios.py's own; on
top, each master must have served the processes' writes, so a process that silently used
one node (its writes to the other masters' slots refused) would fail here."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotinfer.loadgen import Sampling
from spotinfer.local.cluster import LocalCluster
from spotinfer.local.redis_cluster_process import RedisClusterProcess
from store import keys
from tests.drills.test_scenarios import (
    ABRUPT_MAX_MODEL_LEN,
    ABRUPT_OUTPUT_TOKENS,
    _assert_invariants,
    _assert_secure,
    _drill,
)
from tests.support.redis_server import redis_available

pytestmark = pytest.mark.skipif(
    not redis_available(),
    reason="redis-server / redis-cli not on PATH (apt-get install redis-server)",
)

MASTERS = 3
# The processes' own writes: KV blocks (SET) and the record scripts (EVALSHA: create,
# commit, attach, finish). The operator's checks send none of these (EVAL, SCAN, TTL).
WRITE_COMMANDS = ("set", "evalsha")


def _writes_and_keys_per_master(cluster: LocalCluster) -> list[tuple[int, int]]:
    """(writes served, keys of ours held) of every master, asked as the operator."""
    assert isinstance(cluster.redis, RedisClusterProcess)
    assert cluster.redis.masters == MASTERS
    found = []
    for node in cluster.redis.nodes:
        client = cluster.redis.node_client(node)
        stats = client.info("commandstats")
        writes = sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in WRITE_COMMANDS)
        held = sum(1 for _ in client.scan_iter(match=keys.schema_pattern(), count=1000))
        client.close()
        found.append((writes, held))
    return found


def _assert_spread(cluster: LocalCluster) -> None:
    per_master = _writes_and_keys_per_master(cluster)
    assert all(writes > 0 and held > 0 for writes, held in per_master), per_master


def test_notice_on_a_redis_cluster(cluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cluster = cluster_factory(redis_cluster_masters=MASTERS)
    outcome = _drill(
        cluster, tmp_path, scenario="notice", requests=8, output_tokens=(600, 600), time_scale=0.05
    )
    _assert_invariants(outcome, zero_recompute=True)
    assert outcome.report.migrations == 8, "every in-flight request migrated"
    _assert_secure(cluster)
    _assert_spread(cluster)


def test_abrupt_on_a_redis_cluster(cluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cluster = cluster_factory(redis_cluster_masters=MASTERS, max_model_len=ABRUPT_MAX_MODEL_LEN)
    outcome = _drill(
        cluster,
        tmp_path,
        scenario="abrupt",
        requests=8,
        output_tokens=(ABRUPT_OUTPUT_TOKENS, ABRUPT_OUTPUT_TOKENS),
        sampling=Sampling.SEEDED,
    )
    _assert_invariants(outcome, zero_recompute=False)
    assert outcome.report.recoveries == 8
    assert outcome.report.recompute_bound_violations == 0
    recovered = [e for t in outcome.traces for e in t.events if e.kind == "recovered"]
    assert any(e.loaded_tokens >= 256 for e in recovered), "a recovery loaded a stored chunk"
    assert not [n for n in outcome.report.notes if "KV chunk" in n]
    _assert_secure(cluster)
    _assert_spread(cluster)
