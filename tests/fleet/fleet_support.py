"""What the fleet tests share: a booted rehearsal, its greedy references, and waits."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from spotinfer.loadgen import PlannedRequest, RequestTrace, TraceEvent
from spotinfer.rehearsal.fleet import SMALL_WORKER, Rehearsal, RehearsalConfig, Vm
from spotinfer.rehearsal.streams import Streams

VOCAB_SIZE = 512  # the tiny model's
# The daemon looks at the metadata service twice a second (the default suits a real VM).
NODE_ENVIRONMENT = {"SPOTINFER_POLL_INTERVAL_SECONDS": "0.5"}
# Terraform's lease variables: renewed every second, lost after ten (a busy test machine can
# stall a worker's renewal for seconds; the coordinator's own stalls are left out of its
# clock, coordinator/attentive_clock.py).
LEASE_INTERVAL_SECONDS = 1.0
LEASE_TTL_SECONDS = 10.0
BOOT_TIMEOUT_SECONDS = 300.0
# Room for the disturbance tests' streams: long enough (the tiny model decodes hundreds of
# tokens a second) that every one is still decoding when the notice's move is done, so each
# request of the noticed node really moves rather than finishing during the staging.
WORKER_ENVIRONMENT = {
    **SMALL_WORKER,
    "SPOTINFER_MAX_NUM_SEQS": "32",
    "SPOTINFER_MAX_MODEL_LEN": "3072",
}
STREAMS_PER_NODE = 8
NOTICE_OUTPUT = (2400, 2500)
NOTICE_AFTER_TOKENS = 150  # past the first full KV block (128 tokens): it is persisted


@contextmanager
def booted_fleet(model: Path, workdir: Path, cloud: str, nodes: int) -> Iterator[Rehearsal]:
    """A rehearsal fleet whose nodes have all registered; removed afterwards, also when the
    tests fail (the logs of every unit are in the error when it does not come up)."""
    config = RehearsalConfig(
        model=model,
        workdir=workdir,
        cloud=cloud,
        nodes=nodes,
        node_environment=NODE_ENVIRONMENT,
        worker_environment=WORKER_ENVIRONMENT,
        lease_interval_seconds=LEASE_INTERVAL_SECONDS,
        lease_ttl_seconds=LEASE_TTL_SECONDS,
    )
    with Rehearsal(config) as fleet:
        fleet.wait_registered(timeout_seconds=BOOT_TIMEOUT_SECONDS)
        yield fleet


def greedy(fleet: Rehearsal, planned: list[PlannedRequest]) -> dict[str, list[int]]:
    return fleet.greedy_reference(planned)


def wait_for(
    condition: Callable[[], bool], timeout_seconds: float, what: str | Callable[[], str]
) -> float:
    """Seconds until `condition()`; AssertionError naming `what` (or what it returns then)
    after `timeout_seconds`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_seconds:
            said = what if isinstance(what, str) else what()
            raise AssertionError(f"{said}: not within {timeout_seconds:g}s")
        time.sleep(0.1)
    return time.monotonic() - start


def busiest(fleet: Rehearsal, live: list[RequestTrace]) -> Vm:
    """The node producing the most of the streams in flight right now."""
    counts: dict[str, int] = {}
    for trace in live:
        if trace.token_workers and not trace.finish_reason:
            counts[trace.token_workers[-1]] = counts.get(trace.token_workers[-1], 0) + 1
    assert counts, "no stream in flight"
    return fleet.node_named(max(counts, key=lambda worker: counts[worker]))


def on_node_at(streams: Streams, vm: Vm) -> set[str]:
    """The streams whose latest token `vm` produced and that have not ended."""
    return {
        t.request_id
        for t in streams.live
        if t.token_workers and t.token_workers[-1] == vm.worker_id and not t.finish_reason
    }


def every_stream_past(streams: Streams, tokens: int, count: int) -> bool:
    return len(streams.live) >= count and min(len(t.token_ids) for t in streams.live) >= tokens


def wait_mid_stream(fleet: Rehearsal, streams: Streams, count: int) -> None:
    """Until all `count` streams are NOTICE_AFTER_TOKENS in (the error says how far they
    got, and where, if they do not get there)."""

    def progress() -> str:
        where = {t.request_id: (len(t.token_ids), t.token_workers[-1:]) for t in streams.live}
        return f"mid-stream ({len(where)} of {count} started: {where})\n{fleet.logs_tail(1500)}"

    wait_for(lambda: every_stream_past(streams, NOTICE_AFTER_TOKENS, count), 300, progress)


def notice_streams(fleet: Rehearsal) -> int:
    """How many long streams a disturbance test sends: enough to load every node alike."""
    return STREAMS_PER_NODE * len(fleet.nodes)


def assert_moved_without_recompute(
    traces: list[RequestTrace], noticed: Vm, on_it: set[str], others: set[str]
) -> list[TraceEvent]:
    """Every stream that was on `noticed` when the notice came moved to another node (one of
    `others`) and what its migration event says holds: from the noticed node, KV loaded, no
    token recomputed, and every token after it made by the target. The events."""
    assert on_it, "no stream was on the noticed node"
    events = []
    for trace in traces:
        if trace.request_id not in on_it:
            continue
        moves = [e for e in trace.events if e.kind == "migrated"]
        assert len(moves) == 1, (trace.request_id, [(e.kind, e.detail) for e in trace.events])
        move = moves[0]
        assert move.from_worker == noticed.worker_id and move.to_worker in others, move
        assert move.recomputed_tokens == 0 and move.loaded_tokens > 0, move
        after = [
            w
            for at, w in zip(trace.token_times, trace.token_workers, strict=True)
            if at >= move.time
        ]
        assert after and set(after) == {move.to_worker}, trace.request_id
        events.append(move)
    return events
