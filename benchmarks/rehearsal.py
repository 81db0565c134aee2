"""The deployed fleet's two clocks, in the rehearsal (network namespaces, real boot units):
how long a node takes from its units' start to its first served token, and how long a
request waits from a termination notice to its first new token on the target node.

    python -m benchmarks.rehearsal [--model tiny] [--cloud aws] [--boots 2] [--repeats 2]
        [--json docs/bench/rehearsal.json]

Needs root and `ip netns`. Each VM is a namespace booted by its rendered boot script, its
units run by the rehearsal's supervisor; the client is a VM of its own.

- Boot (`--boots` rounds, one node up at a time): ``registered_s`` = the worker unit's start
  → the coordinator lists the node (engine load, registration); ``first_token_s`` = the unit's
  start → the first token of a request the node served, sent from the client VM as soon as
  it was registered.
- Notice (`--repeats` rounds on a fleet of two nodes): 16 long greedy streams (2,400-2,500
  tokens, so every one is still decoding when its move is done); once each is 150 tokens in
  the noticed node's metadata service announces the termination. ``notice_ms`` =
  the announcement → the first token the target node produced for a moved request (the
  watcher's poll, the flush, the move, one decode step); ``gap_ms`` = the longest pause the
  client saw on that stream. Medians over rounds. The JSON also holds the machine's load
  average at the start and the end (`os.getloadavg`).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.harness import benchmark_parser, print_table, write_json
from spotinfer.loadgen import RequestTrace
from spotinfer.rehearsal.fleet import SMALL_WORKER, Rehearsal, RehearsalConfig
from spotinfer.rehearsal.streams import plan

VOCAB_SIZE = 512
NODE_ENVIRONMENT = {"SPOTINFER_POLL_INTERVAL_SECONDS": "0.5"}
WORKER_UNIT = "spotinfer-worker.service"
STREAMS = 16  # 8 per node
NOTICE_OUTPUT = (2400, 2500)
# Room for long streams on a node (the rehearsal's small worker otherwise).
WORKER_ENVIRONMENT = {
    **SMALL_WORKER,
    "SPOTINFER_MAX_NUM_SEQS": "32",
    "SPOTINFER_MAX_MODEL_LEN": "3072",
}


def _model(name: str, workdir: Path) -> Path:
    if name == "tiny":
        from spotinfer.models.tiny import build_tiny_llama

        return build_tiny_llama(workdir / "tiny-model")
    return Path(name)


def measure_boot(fleet: Rehearsal, round_index: int) -> dict[str, float]:
    vm = fleet.add_node()
    fleet.wait_registered([vm], timeout_seconds=600)
    registered = time.time()
    unit_start = vm.services[WORKER_UNIT].starts[0].started_at
    sent = time.perf_counter()
    traces = fleet.run_streams(plan(1, f"boot-{round_index}", VOCAB_SIZE))
    first = traces[0].token_times[0] - sent + registered
    assert traces[0].token_workers[0] == vm.worker_id
    fleet.terminate(vm)
    return {"registered_s": registered - unit_start, "first_token_s": first - unit_start}


def _moved(traces: list[RequestTrace], noticed: str) -> list[RequestTrace]:
    return [t for t in traces if noticed in t.token_workers and t.token_workers[-1] != noticed]


def measure_notice(fleet: Rehearsal, round_index: int) -> dict[str, float]:
    planned = plan(STREAMS, f"notice-{round_index}", VOCAB_SIZE, output_tokens=NOTICE_OUTPUT)
    streams = fleet.streams(planned).start()
    while len(streams.live) < STREAMS or min(len(t.token_ids) for t in streams.live) < 150:
        time.sleep(0.02)
    counts: dict[str, int] = {}
    for trace in streams.live:
        if trace.token_workers and not trace.finish_reason:
            counts[trace.token_workers[-1]] = counts.get(trace.token_workers[-1], 0) + 1
    noticed = fleet.node_named(max(counts, key=lambda worker: counts[worker]))
    announced = time.perf_counter()
    fleet.notice(noticed)
    moved = _moved(streams.join(), noticed.worker_id)
    firsts = [
        next(at for at, w in zip(t.token_times, t.token_workers, strict=True) if at > announced
             and w != noticed.worker_id)
        for t in moved
    ]  # fmt: skip
    fleet.terminate(noticed)
    fleet.add_node()
    fleet.wait_registered(timeout_seconds=600)
    if not moved:  # every stream ended on the noticed node before a move
        return {"moved": 0.0}
    return {
        "notice_ms": (min(firsts) - announced) * 1000,
        "gap_ms": max(t.max_gap_seconds for t in moved) * 1000,
        "moved": float(len(moved)),
    }


def main() -> None:
    parser = benchmark_parser(__doc__, model=False)
    parser.add_argument("--model", default="tiny", help="model folder, or 'tiny'")
    parser.add_argument("--cloud", choices=("aws", "gcp"), default="aws")
    parser.add_argument("--boots", type=int, default=2, help="boot rounds")
    parser.add_argument("--repeats", type=int, default=2, help="notice rounds")
    args = parser.parse_args()
    console = Console()
    workdir = Path(tempfile.mkdtemp(prefix="rehearsal-bench-"))
    config = RehearsalConfig(
        model=_model(args.model, workdir),
        workdir=workdir,
        cloud=args.cloud,
        nodes=0,
        node_environment=NODE_ENVIRONMENT,
        worker_environment=WORKER_ENVIRONMENT,
    )
    result: dict[str, Any] = {
        "cloud": args.cloud,
        "boot": [],
        "notice": [],
        "load_average_start": os.getloadavg(),
    }
    with Rehearsal(config) as fleet:
        for i in range(args.boots):
            result["boot"].append(measure_boot(fleet, i))
            console.print(f"boot {i}: {result['boot'][-1]}")
        for _ in range(2):
            fleet.add_node()
        fleet.wait_registered(timeout_seconds=600)
        for i in range(args.repeats):
            result["notice"].append(measure_notice(fleet, i))
            console.print(f"notice {i}: {result['notice'][-1]}")
    result["load_average_end"] = os.getloadavg()
    rows = []
    for part, keys in (
        ("boot", ("registered_s", "first_token_s")),
        ("notice", ("notice_ms", "gap_ms")),
    ):
        for key in keys:
            values = [r[key] for r in result[part] if key in r]
            if not values:
                rows.append((part, key, "no request moved", "0"))
                continue
            result[f"median_{key}"] = statistics.median(values)
            rows.append((part, key, f"{statistics.median(values):.2f}", f"{len(values)}"))
    print_table(console, f"rehearsal ({args.cloud})", ("part", "measure", "median", "rounds"), rows)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
