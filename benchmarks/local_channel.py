"""How fast the daemon reaches its worker: Stats round trips over loopback TCP vs a unix socket.

    python -m benchmarks.local_channel [--model smollm2-135m] [--calls 2000] [--json OUT]

starts a worker (no persistence) listening on both, then times ``--calls`` sequential unary
Stats calls on each channel (after a warm-up) and prints median, p90 and p99 in microseconds.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import benchmark_parser, percentile, resolve_model_arg, write_json
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


def summary_us(samples: list[float]) -> dict[str, float]:
    return {
        "median_us": statistics.median(samples) * 1e6,
        "p90_us": percentile(samples, 0.90) * 1e6,
        "p99_us": percentile(samples, 0.99) * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    model = resolve_model_arg(args.model)
    with tempfile.TemporaryDirectory() as scratch:
        socket_path = Path(scratch) / "worker.sock"
        with WorkerProcess(
            model, *WORKER_FLAGS, "--unix-socket", str(socket_path), log_dir=Path(scratch)
        ) as worker:
            samples = {
                "tcp loopback": time_calls(worker.address, args.calls),
                "unix socket": time_calls(f"unix:{socket_path}", args.calls),
            }
    result = {name: summary_us(values) for name, values in samples.items()}
    for name, us in result.items():
        print(
            f"{name:13s} {args.calls} Stats calls: median {us['median_us']:7.1f} us   "
            f"p90 {us['p90_us']:7.1f} us   p99 {us['p99_us']:7.1f} us"
        )
    write_json(args.json, {"model": model, "calls": args.calls, "channels": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
