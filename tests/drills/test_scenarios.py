"""Every drill scenario at small scale on the tiny model, every invariant asserted.

Each test starts its own local cluster (redis-server, coordinator, workers with daemons and
metadata servers): scenarios destroy what they touch.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from common.channels import PLAINTEXT, TransportConfig, sync_channel
from protos.spotinfer.v1 import common_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc
from spotinfer.drills.report import ClusterEvent
from spotinfer.drills.runner import (
    PREEMPTION_EVENTS,
    DrillOptions,
    DrillOutcome,
    plan,
    run_drill,
)
from spotinfer.loadgen import RequestTrace, Sampling
from spotinfer.local.cluster import LocalCluster

TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "spotserve" / "As.jsonl"
# The abrupt drills kill the serving worker once half the requests have 352 tokens (half a
# chunk past the first 256-token chunk) as the load generator counts them; on a busy machine
# the generator's count lags the worker's by hundreds of tokens (a worker killed at 352 by
# that count had produced 936). The outputs run long, so that the kill finds the requests
# mid-stream: at 700 tokens the tiny model had finished them all (in ~2.6 s) before the
# generator had counted 352.
ABRUPT_OUTPUT_TOKENS = 1900
ABRUPT_MAX_MODEL_LEN = 2048


def _drill(cluster: LocalCluster, tmp_path: Path, **options: object) -> DrillOutcome:
    drill_options = DrillOptions(**options)  # type: ignore[arg-type]
    vocab = json.loads(Path(cluster.config.model, "config.json").read_text())["vocab_size"]
    return run_drill(cluster, drill_options, plan(drill_options, vocab), png=tmp_path / "t.png")


def _assert_invariants(outcome: DrillOutcome, zero_recompute: bool) -> None:
    report = outcome.report
    failed = [(c.name, c.value) for c in report.checks if not c.passed]
    assert report.verdict == "PASS", failed
    assert report.lost == 0 and report.duplicates == 0 and report.gaps == 0
    assert report.fidelity_mismatches == 0 and report.leaked_keys == 0
    assert len(outcome.references) == report.requests, "every request has a reference"
    if zero_recompute:
        assert report.recomputed_tokens == 0
    assert outcome.png is not None and outcome.png.read_bytes()[:4] == b"\x89PNG"


def _moved_off(traces: list[RequestTrace], worker: str) -> int:
    """Requests that had tokens from `worker` and finished elsewhere."""
    return sum(
        1
        for t in traces
        if worker in t.token_workers and t.token_workers and t.token_workers[-1] != worker
    )


def _code(call: object) -> grpc.StatusCode:
    try:
        for _ in call:  # type: ignore[attr-defined]
            break
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[attr-defined, no-any-return]
    return grpc.StatusCode.OK


def _generate(address: str, transport: TransportConfig, api_key: str) -> grpc.StatusCode:
    request = common_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3])
    with sync_channel(address, transport=transport, api_key=api_key) as channel:
        return _code(inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=10))


def _worker_stats(address: str, transport: TransportConfig) -> grpc.StatusCode:
    with sync_channel(address, transport=transport) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        try:
            stub.Stats(worker_pb2.StatsRequest(), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[attr-defined, no-any-return]
    return grpc.StatusCode.OK


def _assert_secure(cluster: LocalCluster) -> None:
    """The drill ran with TLS, mutual TLS and API keys on, and still does (after a restart
    too): the coordinator refuses plaintext and a call without a key, and every live worker
    refuses a client without a cluster certificate."""
    assert cluster.config.secure and cluster.api_key
    coordinator = cluster.coordinator.address
    unavailable = grpc.StatusCode.UNAVAILABLE
    assert _generate(coordinator, PLAINTEXT, cluster.api_key) == unavailable
    keyless = _generate(coordinator, cluster.client_transport, "")
    assert keyless == grpc.StatusCode.UNAUTHENTICATED
    # A node the drill noticed, stopped or killed may be going down right now (its grace
    # timer, its own stop once its requests moved): only the others are asked.
    gone = {e.target for e in cluster.events if e.kind in PREEMPTION_EVENTS}
    live = [node for node in cluster.nodes.values() if node.alive and node.name not in gone]
    assert live, "a node to check"
    for node in live:
        address = node.worker.address
        assert _worker_stats(address, cluster.client_transport) == unavailable
        assert _worker_stats(address, cluster.operator_transport) == grpc.StatusCode.OK


def _notices(cluster: LocalCluster) -> list[ClusterEvent]:
    return [e for e in cluster.events if e.kind == "notice"]


def _in_flight_at(traces: list[RequestTrace], worker: str, when: float) -> int:
    """Requests that `worker` had produced tokens for by `when` and that were not done yet:
    what a notice to it at that moment disturbed (they then migrate, or finish on it while
    their blocks are staged on the target)."""
    return sum(
        1
        for t in traces
        if t.token_times
        and t.token_times[-1] > when
        and any(
            w == worker and tm <= when for tm, w in zip(t.token_times, t.token_workers, strict=True)
        )
    )


def test_notice(cluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cluster = cluster_factory()
    outcome = _drill(
        cluster, tmp_path, scenario="notice", requests=8, output_tokens=(600, 600), time_scale=0.05
    )
    _assert_invariants(outcome, zero_recompute=True)
    assert outcome.report.migrations == 8, "every in-flight request migrated"
    _assert_secure(cluster)


def test_notice_in_gcp_format(cluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A GCP notice is only TRUE: the VMs are given a 6 s notice length (told to their
    daemons), which the drill's time scale does not shorten, and every request moves."""
    cluster = cluster_factory(cloud="gcp", notice_seconds=6.0)
    outcome = _drill(
        cluster, tmp_path, scenario="notice", requests=6, output_tokens=(600, 600), time_scale=0.2
    )
    _assert_invariants(outcome, zero_recompute=True)
    assert outcome.report.migrations == 6
    assert any("daemon's 6 s, not scaled" in note for note in outcome.report.notes)
    with pytest.raises(ValueError, match="carries no deadline"):
        _drill(cluster, tmp_path, scenario="notice", requests=1, grace_seconds=10.0)


def test_sigterm(cluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A worker stopped by its service manager moves its requests as on a notice (a short
    grace, as the notice drill's: the requests must still be running when they move)."""
    cluster = cluster_factory(worker_flags=("--drain-grace-seconds", "6"))
    outcome = _drill(cluster, tmp_path, scenario="sigterm", requests=8, output_tokens=(600, 600))
    _assert_invariants(outcome, zero_recompute=True)
    (stopped,) = [e.target for e in cluster.events if e.kind == "sigterm"]
    assert outcome.report.migrations == _moved_off(outcome.traces, stopped) > 0


def test_drain(cluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """An operator's Control.Drain moves the worker's requests as a notice does. The load
    samples (temperature 1, a seed per request): each migrated request goes on with the same
    random sequence, so its output equals the undisturbed seeded run."""
    cluster = cluster_factory()
    outcome = _drill(
        cluster,
        tmp_path,
        scenario="drain",
        requests=8,
        output_tokens=(600, 600),
        time_scale=0.05,
        sampling=Sampling.SEEDED,
    )
    _assert_invariants(outcome, zero_recompute=True)
    (drained,) = [e.target for e in cluster.events if e.kind == "drain"]
    assert outcome.report.migrations == _moved_off(outcome.traces, drained) > 0


def test_scale_in(cluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The auto scaling group terminates a node (AWS target lifecycle state): no spot notice,
    and still every request on it migrates with nothing recomputed."""
    cluster = cluster_factory(cloud="aws", lifecycle_drain_seconds=6.0)
    outcome = _drill(cluster, tmp_path, scenario="scale-in", requests=8, output_tokens=(600, 600))
    _assert_invariants(outcome, zero_recompute=True)
    (scaled,) = [e.target for e in cluster.events if e.kind == "scale-in"]
    assert outcome.report.migrations == _moved_off(outcome.traces, scaled) > 0
    imds = cluster.nodes[scaled].metadata
    assert imds.seen("GET", "/latest/meta-data/autoscaling/target-lifecycle-state")
    assert imds.instance_action is None, "no spot notice was given"


def test_azure_preempt_is_approved_after_the_flush(cluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cluster = cluster_factory(cloud="azure")
    outcome = _drill(
        cluster, tmp_path, scenario="notice", requests=6, output_tokens=(600, 600), time_scale=0.2
    )
    _assert_invariants(outcome, zero_recompute=True)
    (noticed,) = [e.target for e in _notices(cluster)]
    events = cluster.nodes[noticed].metadata
    (event,) = events.events
    assert events.approved == [event["EventId"]]
    # Once, and only once the flush had saved every request: each migrated with nothing
    # recomputed (the order against the flush itself: tests/context_daemon/test_handoff.py).
    assert len(events.seen("POST", "/metadata/scheduledevents")) == 1
    assert outcome.report.migrations == _moved_off(outcome.traces, noticed) > 0


def test_abrupt(cluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cluster = cluster_factory(max_model_len=ABRUPT_MAX_MODEL_LEN)
    # The kill lands half a KV chunk past the requests' first 256-token chunk (352 new
    # tokens for the drill's 32-96-token prompts), with room for a request that runs ahead.
    # Seeded sampling: each recovery continues from the tokens its client received and
    # with the same random sequence, so its output equals the undisturbed seeded run.
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


def test_redis_restart(cluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cluster = cluster_factory(standbys=0)
    outcome = _drill(
        cluster, tmp_path, scenario="redis-restart", requests=8, output_tokens=(400, 400)
    )
    _assert_invariants(outcome, zero_recompute=True)
    assert [e.kind for e in cluster.events] == ["redis-restart"]


def test_coordinator_restart(cluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cluster = cluster_factory(standbys=0)
    outcome = _drill(
        cluster, tmp_path, scenario="coordinator-restart", requests=8, output_tokens=(600, 600)
    )
    _assert_invariants(outcome, zero_recompute=False)
    assert any(t.reattached for t in outcome.traces), "the clients' streams really broke"
    _assert_secure(cluster)


def test_storm(cluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Two active workers noticed at once, one standby: the standby cannot take all the
    # running requests at once, so some wait — and still complete.
    cluster = cluster_factory(workers=2, standbys=1)
    outcome = _drill(
        cluster, tmp_path, scenario="storm", requests=12, output_tokens=(500, 500), time_scale=0.05
    )
    _assert_invariants(outcome, zero_recompute=True)
    assert len([e for e in cluster.events if e.kind == "notice"]) == 2


def _migrated_once_to(traces: list[RequestTrace], lost: set[str], allowed: set[str]) -> int:
    """Requests that had tokens from a ``lost`` node: each moved once (one MIGRATED event)
    and finished on an ``allowed`` node. Returns how many there were."""
    moved = [t for t in traces if lost & set(t.token_workers)]
    for trace in moved:
        kinds = [e.kind for e in trace.events]
        assert kinds.count("migrated") == 1, (trace.request_id, kinds)
        assert trace.token_workers[-1] in allowed, (trace.request_id, trace.token_workers[-1])
    return len(moved)


def test_correlated_wave_with_an_on_demand_fallback(cluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Every spot node (the active one and its standby) noticed within 2 s: the standby is
    no refuge. The one on-demand fallback node takes every moving request, nothing is
    recomputed, and each moves once."""
    cluster = cluster_factory(workers=1, standbys=1, fallback_nodes=1)
    outcome = _drill(
        cluster,
        tmp_path,
        scenario="correlated",
        requests=8,
        output_tokens=(600, 600),
        time_scale=0.05,
    )
    _assert_invariants(outcome, zero_recompute=True)
    notices = _notices(cluster)
    (fallback,) = [n.name for n in cluster.nodes.values() if n.fallback]
    assert {e.target for e in notices} == {"node-0", "node-1"}, "every spot node"
    assert max(e.time for e in notices) - min(e.time for e in notices) <= 2.0
    joined = {e.target for e in cluster.events if e.kind == "join"}
    moved = _migrated_once_to(outcome.traces, {"node-0"}, {fallback} | joined)
    assert moved == outcome.report.migrations > 0
    assert any(t.token_workers[-1] == fallback for t in outcome.traces)
    assert any(f"on-demand fallback: {fallback}" in n for n in outcome.report.notes)


def test_correlated_wave_without_a_fallback_waits_for_the_replacement(
    cluster_factory,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    """No node is left when the wave has passed (a request that moved to the standby before
    its own notice came moves on or ends there): the requests that arrive meanwhile wait,
    within the coordinator's capacity wait, for the replacement that boots, and none is
    lost."""
    cluster = cluster_factory(
        workers=1,
        standbys=1,
        coordinator_flags=("--record-retention-seconds", "1", "--capacity-wait-seconds", "300"),
    )
    outcome = _drill(
        cluster,
        tmp_path,
        scenario="correlated",
        requests=12,
        rate_per_second=1.0,
        output_tokens=(600, 600),
        time_scale=0.05,
    )
    _assert_invariants(outcome, zero_recompute=True)
    (joined,) = [e.target for e in cluster.events if e.kind == "join"]
    assert outcome.report.migrations > 0
    wave_end = max(e.time for e in _notices(cluster))
    late = [t for t in outcome.traces if t.sent_at > wave_end]
    assert late, "requests arrived in the gap"
    # Each waited for the replacement (one placed on the standby just before its notice
    # was heard moved there too).
    assert all(t.token_workers[-1] == joined for t in late), [t.token_workers[-1] for t in late]


def test_zone_outage_moves_every_request_to_the_other_zone(cluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two zones; every node of the serving node's zone is noticed at once (its standby
    too): each request moves once, to the other zone, with nothing recomputed."""
    cluster = cluster_factory(workers=1, standbys=2, zones=("zone-a", "zone-b"))
    zone_of = {n.name: n.zone for n in cluster.nodes.values()}
    assert zone_of == {"node-0": "zone-a", "node-1": "zone-b", "node-2": "zone-a"}
    outcome = _drill(
        cluster, tmp_path, scenario="zone", requests=8, output_tokens=(600, 600), time_scale=0.05
    )
    _assert_invariants(outcome, zero_recompute=True)
    assert {e.target for e in _notices(cluster)} == {"node-0", "node-2"}
    moved = _migrated_once_to(outcome.traces, {"node-0"}, {"node-1"})
    assert moved == outcome.report.migrations > 0


def test_rolling(cluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Two preemptions 10 s apart with two warm standbys: each notice finds one ready, while
    # the replacements boot in the background. Arrivals span 24 s and keep ~5 requests in
    # flight (the tiny model decodes a 700-token answer in about 2 s), so both notices hit
    # requests mid-stream. Grace ×0.05 = 6 s (AWS), enough for a flush on a busy 2-core box.
    cluster = cluster_factory(standbys=2)
    outcome = _drill(
        cluster,
        tmp_path,
        scenario="rolling",
        requests=72,
        rate_per_second=3.0,
        output_tokens=(600, 800),
        time_scale=0.05,
        interval_seconds=10.0,
        duration_seconds=15.0,
    )
    _assert_invariants(outcome, zero_recompute=True)
    noticed = [e.target for e in cluster.events if e.kind == "notice"]
    assert len(noticed) == 2 and outcome.report.preemptions == 2
    assert [e.kind for e in cluster.events].count("join") == 2, "each lost node is replaced"
    hits = [_in_flight_at(outcome.traces, e.target, e.time) for e in _notices(cluster)]
    assert all(hits), f"each notice found requests mid-stream on its node: {hits}"
    assert outcome.report.migrations > 0


@pytest.mark.skipif(not TRACE.exists(), reason=f"the SpotServe trace is not at {TRACE}")
def test_trace(cluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # The whole A_S trace at ×0.05 (22 min → 66 s, grace 6 s), mapped by fraction onto four
    # nodes (its 7 first nodes): joins at 12, 18 and 45 s (8 and 10 trace nodes scale to 5
    # and 6 local), booting in the background; removals at 30 s (1 of 10) and 60 s (2 of
    # 10), one node each. The cluster keeps serving nodes through both however slowly the
    # joins boot (55 s here on a busy box). Arrivals span the 66 s, ~5 requests in flight.
    cluster = cluster_factory(workers=2, standbys=2)
    outcome = _drill(
        cluster,
        tmp_path,
        scenario="trace",
        requests=132,
        rate_per_second=2.0,
        output_tokens=(500, 700),
        time_scale=0.05,
        trace_file=TRACE,
    )
    _assert_invariants(outcome, zero_recompute=True)
    kinds = [e.kind for e in cluster.events]
    assert kinds.count("notice") == 2 and kinds.count("join") == 3  # A_S at this scale
    notes = outcome.report.notes
    assert any(
        "trace mapped by fraction: its 7 first nodes are the cluster's 4" in n for n in notes
    )
    assert any("trace removes 2 of 10 (20%) → 1 of" in n for n in notes), notes
    hits = [_in_flight_at(outcome.traces, e.target, e.time) for e in _notices(cluster)]
    assert any(hits), f"some notice found requests mid-stream on its node: {hits}"
