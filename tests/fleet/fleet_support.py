"""What the fleet tests share: a booted rehearsal, its greedy references, and waits."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from spotinfer.loadgen import PlannedRequest, RequestTrace
from spotinfer.rehearsal.fleet import SMALL_WORKER, Rehearsal, RehearsalConfig, Vm
from spotinfer.rehearsal.streams import Streams

VOCAB_SIZE = 512  # the tiny model's
# The daemon looks at the metadata service twice a second (the default suits a real VM).
NODE_ENVIRONMENT = {"SPOTINFER_POLL_INTERVAL_SECONDS": "0.5"}
# Terraform's lease variables: renewed every second, lost after three.
LEASE_INTERVAL_SECONDS = 1.0
LEASE_TTL_SECONDS = 3.0
BOOT_TIMEOUT_SECONDS = 240.0
# Room for the notice tests' streams: many at once keep each one slow enough (the tiny
# model decodes hundreds of tokens a second) that a notice lands well before its end.
WORKER_ENVIRONMENT = {**SMALL_WORKER, "SPOTINFER_MAX_NUM_SEQS": "32"}
STREAMS_PER_NODE = 16  # as the rehearsal benchmark, where every notice moved streams
NOTICE_OUTPUT = (940, 960)
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


def wait_for(condition: Callable[[], bool], timeout_seconds: float, what: str) -> float:
    """Seconds until `condition()`; AssertionError naming `what` after `timeout_seconds`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_seconds:
            raise AssertionError(f"{what}: not within {timeout_seconds:g}s")
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


def every_stream_past(streams: Streams, tokens: int, count: int) -> bool:
    return len(streams.live) >= count and min(len(t.token_ids) for t in streams.live) >= tokens


def notice_streams(fleet: Rehearsal) -> int:
    """How many long streams a disturbance test sends: enough to load every node alike."""
    return STREAMS_PER_NODE * len(fleet.nodes)
