"""How fast the daemon reaches its worker: Stats round trips over loopback TCP vs a unix socket.

    python -m spotinfer.bench.local_channel --model MODEL_DIR [--calls 2000]

starts a worker (no persistence) listening on both, then times ``--calls`` sequential unary
Stats calls on each channel (after a warm-up) and prints median, p90 and p99 in microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common.channels import sync_channel
from protos.spotinfer.v1 import worker_pb2, worker_pb2_grpc
from spotinfer.local.worker_process import WorkerProcess

WARMUP_CALLS = 200
WORKER_FLAGS = ("--dtype", "float32", "--max-model-len", "1024", "--memory-gib", "0.25")


def time_calls(address: str, calls: int) -> list[float]:
    """Seconds per Stats round trip, ``calls`` of them, one after another."""
    with sync_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for _ in range(WARMUP_CALLS):
            stub.Stats(worker_pb2.StatsRequest(), timeout=5)
        samples = []
        for _ in range(calls):
            start = time.perf_counter()
            stub.Stats(worker_pb2.StatsRequest(), timeout=5)
            samples.append(time.perf_counter() - start)
    return samples


def summary_us(samples: list[float]) -> str:
    ordered = sorted(samples)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1e6

    return (
        f"median {statistics.median(ordered) * 1e6:7.1f} us   "
        f"p90 {pct(0.90):7.1f} us   p99 {pct(0.99):7.1f} us"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="model folder the worker loads")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        socket_path = Path(scratch) / "worker.sock"
        with WorkerProcess(
            args.model, *WORKER_FLAGS, "--unix-socket", str(socket_path), log_dir=Path(scratch)
        ) as worker:
            results = {
                "tcp loopback": time_calls(worker.address, args.calls),
                "unix socket": time_calls(f"unix:{socket_path}", args.calls),
            }
    for name, samples in results.items():
        print(f"{name:13s} {len(samples)} Stats calls: {summary_us(samples)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
