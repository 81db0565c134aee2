"""Tokens/s through the coordinator vs straight from the worker, under the same load.

    python -m benchmarks.relay_overhead [--model smollm2-135m] [--rounds 4] [--json OUT]

One worker; one coordinator in front of it. Each round sends the same 16 concurrent
streaming requests (128 output tokens each, greedy, EOS ignored) once straight to
`Worker.Generate` and once to the coordinator's `Inference.Generate`, in alternating order
so that machine noise hits both paths alike. Reported: tokens/s (median over rounds) and
their ratio; the per-token latency a client sees — the gap between two consecutive tokens
of a stream (a message carrying k tokens counts as k gaps of 1/k of its wait) — at p50 and
p99 on each path, and what the relay adds to it; and time to first token.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from typing import Any

import grpc
from rich.console import Console
from rich.progress import Progress

from benchmarks.harness import (
    alternating,
    benchmark_parser,
    engine_flags,
    percentile,
    print_table,
    prompt_ids,
    resolve_model_arg,
    write_json,
)
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.worker_process import WorkerProcess

MAX_MODEL_LEN = 2048
KV_CACHE_BYTES = 1 << 30
MAX_NUM_SEQS = 64
PATHS = ("worker", "coordinator")


def run_load(generate: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Sends every prompt at once as its own stream; returns tokens, seconds, gaps, TTFTs."""
    from protos.spotinfer.v1 import common_pb2

    gaps_ms: list[float] = []
    ttft_ms: list[float] = []
    counts: list[int] = []
    lock = threading.Lock()
    start_gate = threading.Barrier(len(prompts) + 1)

    def one(ids: list[int]) -> None:
        request = common_pb2.GenerateRequest(
            prompt_token_ids=ids,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        start_gate.wait()
        start = last = time.perf_counter()
        first: float | None = None
        mine: list[float] = []
        n = 0
        for response in generate(request, timeout=900):
            now = time.perf_counter()
            k = len(response.token_ids)
            if not k:
                continue
            if first is None:
                first = (now - start) * 1000
            else:
                mine.extend([(now - last) * 1000 / k] * k)
            last = now
            n += k
        with lock:
            gaps_ms.extend(mine)
            ttft_ms.append(first or 0.0)
            counts.append(n)

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    start_gate.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(counts), "gaps_ms": gaps_ms, "ttft_ms": ttft_ms}


def measure(model: str, requests: int, max_tokens: int, rounds: int, dtype: str) -> dict[str, Any]:
    prompts = prompt_ids(model, requests)
    flags = engine_flags(dtype, MAX_MODEL_LEN, KV_CACHE_BYTES, MAX_NUM_SEQS)
    runs: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
    with Progress() as progress:
        task = progress.add_task("starting worker and coordinator", total=rounds * 2 + 1)
        worker = WorkerProcess(model, *flags).start()
        coordinator = CoordinatorProcess("--worker", worker.address, "--model", model)
        try:
            coordinator.start()
            _wait_routable(coordinator)
            channels = {
                "worker": worker.stub.Generate,
                "coordinator": coordinator.inference.Generate,
            }
            for path in PATHS:  # warm-up: first calls pay one-off costs
                run_load(channels[path], prompts[:2], 8)
            progress.update(task, advance=1, description="measuring")
            for _, path in alternating(PATHS, rounds):
                runs[path].append(run_load(channels[path], prompts, max_tokens))
                progress.update(task, advance=1)
        finally:
            coordinator.stop()
            worker.stop()
    return summarize(runs, model, requests, max_tokens, dtype)


def _wait_routable(coordinator: CoordinatorProcess, timeout: float = 60.0) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    assert coordinator.channel is not None
    stub = health_pb2_grpc.HealthStub(coordinator.channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            if answer.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise TimeoutError("the coordinator never saw its worker ready")


def summarize(
    runs: dict[str, list[dict[str, Any]]], model: str, requests: int, max_tokens: int, dtype: str
) -> dict[str, Any]:
    def tps(path: str) -> float:
        return statistics.median(r["tokens"] / r["seconds"] for r in runs[path])

    def pooled(path: str, key: str) -> list[float]:
        return [v for r in runs[path] for v in r[key]]

    latency = {
        path: {
            "p50": percentile(pooled(path, "gaps_ms"), 0.5),
            "p99": percentile(pooled(path, "gaps_ms"), 0.99),
        }
        for path in PATHS
    }
    ttft = {path: percentile(pooled(path, "ttft_ms"), 0.5) for path in PATHS}
    return {
        "model": model,
        "dtype": dtype,
        "requests": requests,
        "max_tokens": max_tokens,
        "rounds": len(runs["worker"]),
        "tokens_per_second": {path: tps(path) for path in PATHS},
        "coordinator_vs_worker_ratio": tps("coordinator") / tps("worker"),
        "per_token_latency_ms": latency,
        "added_per_token_latency_ms": {
            q: latency["coordinator"][q] - latency["worker"][q] for q in ("p50", "p99")
        },
        "ttft_ms_p50": ttft,
        "added_ttft_ms_p50": ttft["coordinator"] - ttft["worker"],
        "runs": [
            {"path": path, "seconds": r["seconds"], "tokens": r["tokens"]}
            for path in PATHS
            for r in runs[path]
        ],
    }


def print_report(result: dict[str, Any], console: Console) -> None:
    rows = []
    for path in PATHS:
        latency = result["per_token_latency_ms"][path]
        rows.append(
            (
                path,
                f"{result['tokens_per_second'][path]:.1f}",
                f"{latency['p50']:.2f}",
                f"{latency['p99']:.2f}",
                f"{result['ttft_ms_p50'][path]:.1f}",
            )
        )
    print_table(
        console,
        f"Relay overhead, {result['model']} ({result['dtype']}), "
        f"{result['requests']} × {result['max_tokens']} tokens, {result['rounds']} rounds",
        ("path", "tokens/s (median)", "per-token p50 ms", "per-token p99 ms", "TTFT p50 ms"),
        rows,
    )
    added = result["added_per_token_latency_ms"]
    console.print(
        f"coordinator / worker = {result['coordinator_vs_worker_ratio']:.3f}; added per-token "
        f"latency p50 {added['p50']:+.2f} ms, p99 {added['p99']:+.2f} ms; added TTFT p50 "
        f"{result['added_ttft_ms_p50']:+.1f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, rounds=4, dtype="bfloat16")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    model = resolve_model_arg(args.model)
    result = measure(model, args.requests, args.max_tokens, args.rounds, args.dtype)
    print_report(result, Console())
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
