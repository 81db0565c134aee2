"""Memory interference: what work on one core costs a decode-like step on the other.

    python -m benchmarks.memory_interference [--rounds 3] [--samples 30] [--json FILE]

The probe, pinned to the first CPU with one thread: a bfloat16 matrix-vector product over
~270 MB of weights (SmolLM2-135M's, which a decode step streams from memory once), 8
columns (8 sequences). Beside it, pinned to the second CPU, one neighbour at a time:

- ``idle``: nothing.
- ``compute``: a Python loop (the core busy, memory untouched).
- ``copy_94MB``: copying a 94 MB buffer over and over (a 4k-token context's KV of that
  model, moved through memory whole).
- ``copy_256KiB``: the same, 256 KiB at a time in one place (a piece that stays in the
  core's L2 cache: how the KV fetcher moves a read, store.redis_store.get_blocks_into).
- ``hmac_256KiB``: HMAC-SHA256 over a 256 KiB piece (the fetcher's check, cache-resident).

    slowdown = the probe's median time beside the neighbour ÷ its median time beside idle

Rounds rotate the neighbours' order (benchmarks.harness.rotated); medians over all samples.
A step that streams its weights is bound by memory bandwidth, not by its core: what slows
it is bytes moved through memory on the other core, not that core being busy.
"""

from __future__ import annotations

import hashlib
import hmac
import multiprocessing
import os
import statistics
import sys
import time
from multiprocessing.synchronize import Event
from typing import Any

from rich.console import Console
from rich.progress import Progress

from benchmarks.harness import benchmark_parser, cpu_description, print_table, rotated, write_json

NEIGHBOURS = ("idle", "compute", "copy_94MB", "copy_256KiB", "hmac_256KiB")
WEIGHT_BYTES = 270 * 10**6
HIDDEN = 576
COLUMNS = 8
BIG_COPY_BYTES = 94 * 10**6
PIECE_BYTES = 256 * 1024
WARM_SECONDS = 0.5
PROBE_CPU = 0
NEIGHBOUR_CPU = 1


def _neighbour(kind: str, stop: Event) -> None:
    os.sched_setaffinity(0, {NEIGHBOUR_CPU})
    size = BIG_COPY_BYTES if kind == "copy_94MB" else PIECE_BYTES
    source = bytearray(os.urandom(PIECE_BYTES)) * (size // PIECE_BYTES)
    target = bytearray(len(source))
    key = b"k" * 32
    while not stop.is_set():
        if kind == "compute":
            total = 0
            for i in range(100_000):
                total += i
        elif kind.startswith("copy_"):
            target[:] = source
        elif kind == "hmac_256KiB":
            hmac.new(key, source, hashlib.sha256).digest()
        else:
            stop.wait(0.05)


def _probe_ms(samples: int) -> list[float]:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    weights = torch.randn(WEIGHT_BYTES // 2 // HIDDEN, HIDDEN).to(torch.bfloat16)
    vector = torch.randn(HIDDEN, COLUMNS).to(torch.bfloat16)
    weights @ vector  # warm
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        weights @ vector
        times.append((time.perf_counter() - start) * 1000)
    return times


def measure(rounds: int, samples: int, console: Console) -> dict[str, Any]:
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("memory_interference needs two CPUs: a probe's and a neighbour's")
    os.sched_setaffinity(0, {PROBE_CPU})
    times: dict[str, list[float]] = {kind: [] for kind in NEIGHBOURS}
    context = multiprocessing.get_context("spawn")
    with Progress(console=console) as progress:
        task = progress.add_task("probe beside each neighbour", total=rounds * len(NEIGHBOURS))
        for round_index in range(rounds):
            for kind in rotated(NEIGHBOURS, round_index):
                stop = context.Event()
                process = context.Process(target=_neighbour, args=(kind, stop))
                process.start()
                time.sleep(WARM_SECONDS)
                try:
                    times[kind] += _probe_ms(samples)
                finally:
                    stop.set()
                    process.join()
                progress.advance(task)
    idle = statistics.median(times["idle"])
    return {
        "cpu": cpu_description(),
        "weight_bytes": WEIGHT_BYTES,
        "rounds": rounds,
        "samples_per_round": samples,
        "median_ms": {kind: statistics.median(t) for kind, t in times.items()},
        "slowdown": {kind: statistics.median(t) / idle for kind, t in times.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, model=False, rounds=3)
    parser.add_argument("--samples", type=int, default=30, help="probe runs per neighbour, round")
    args = parser.parse_args(argv)
    console = Console()
    result = measure(args.rounds, args.samples, console)
    write_json(args.json, result)
    rows = [
        [kind, f"{result['median_ms'][kind]:.1f}", f"{result['slowdown'][kind]:.2f}"]
        for kind in NEIGHBOURS
    ]
    columns = ["neighbour on the other core", "probe ms (median)", "slowdown"]
    print_table(console, "A 270 MB bf16 matrix-vector product beside ...", columns, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
