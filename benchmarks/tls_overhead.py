"""Relay throughput with TLS and mutual TLS on every hop vs plaintext, in the same run.

    python -m benchmarks.tls_overhead [--model smollm2-135m] [--rounds 4] [--json OUT]

Two stacks side by side, each one worker behind one coordinator: ``plaintext`` (no TLS, no
keys, as the tests run) and ``tls`` (the client → coordinator hop over TLS with an API key,
coordinator → worker over mutual TLS, certificates from `spotinfer.local.certs`). Each round
sends the same concurrent streaming requests (greedy, EOS ignored) through each stack's
`Inference.Generate`, in alternating order so machine noise hits both alike (see
benchmarks/relay_overhead.py for the load). Reported: tokens/s (median over rounds), the
tls / plaintext ratio (target >= 0.97), per-token latency p50/p99 and TTFT on each stack.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

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
from benchmarks.relay_overhead import _wait_routable, run_load
from protos.spotinfer.v1 import inference_pb2_grpc
from spotinfer.local.cluster_secrets import ClusterSecrets
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.worker_process import WorkerProcess

MAX_MODEL_LEN = 2048
KV_CACHE_BYTES = 1 << 29
MAX_NUM_SEQS = 64
STACKS = ("plaintext", "tls")


def _stack(
    model: str, flags: tuple[str, ...], secrets: ClusterSecrets | None
) -> tuple[WorkerProcess, CoordinatorProcess, Any]:
    """A worker and a coordinator in front of it; returns them and the Generate to call."""
    from common.channels import sync_channel

    if secrets is None:
        worker = WorkerProcess(model, *flags).start()
        coordinator = CoordinatorProcess("--worker", worker.address, "--model", model).start()
        _wait_routable(coordinator)
        return worker, coordinator, coordinator.inference.Generate
    operator = secrets.operator_transport
    worker = WorkerProcess(model, *flags, *secrets.flags("worker"), transport=operator).start()
    coordinator = CoordinatorProcess(
        *("--worker", worker.address, "--model", model),
        *secrets.flags("coordinator"),
        transport=operator,
    ).start()
    _wait_routable(coordinator)
    channel = sync_channel(
        coordinator.address, transport=secrets.client_transport, api_key=secrets.api_key
    )
    return worker, coordinator, inference_pb2_grpc.InferenceStub(channel).Generate


def measure(model: str, requests: int, max_tokens: int, rounds: int, dtype: str) -> dict[str, Any]:
    prompts = prompt_ids(model, requests)
    flags = engine_flags(dtype, MAX_MODEL_LEN, KV_CACHE_BYTES, MAX_NUM_SEQS)
    runs: dict[str, list[dict[str, Any]]] = {stack: [] for stack in STACKS}
    started: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="spotinfer-tls-bench-") as folder:
        secrets = ClusterSecrets.make(Path(folder))
        try:
            generate = {}
            for stack in STACKS:
                worker, coordinator, call = _stack(
                    model, flags, secrets if stack == "tls" else None
                )
                started += [coordinator, worker]
                generate[stack] = call
            for stack in STACKS:  # warm-up: first calls pay one-off costs (handshakes too)
                run_load(generate[stack], prompts[:2], 8)
            for _, stack in alternating(STACKS, rounds):
                runs[stack].append(run_load(generate[stack], prompts, max_tokens))
        finally:
            for process in started:
                process.stop()
    return summarize(runs, model, requests, max_tokens, dtype)


def summarize(
    runs: dict[str, list[dict[str, Any]]], model: str, requests: int, max_tokens: int, dtype: str
) -> dict[str, Any]:
    def tps(stack: str) -> float:
        return statistics.median(r["tokens"] / r["seconds"] for r in runs[stack])

    def pooled(stack: str, key: str) -> list[float]:
        return [v for r in runs[stack] for v in r[key]]

    return {
        "model": model,
        "dtype": dtype,
        "requests": requests,
        "max_tokens": max_tokens,
        "rounds": len(runs["tls"]),
        "tokens_per_second": {stack: tps(stack) for stack in STACKS},
        "tls_vs_plaintext_ratio": tps("tls") / tps("plaintext"),
        "per_token_latency_ms": {
            stack: {
                "p50": percentile(pooled(stack, "gaps_ms"), 0.5),
                "p99": percentile(pooled(stack, "gaps_ms"), 0.99),
            }
            for stack in STACKS
        },
        "ttft_ms_p50": {stack: percentile(pooled(stack, "ttft_ms"), 0.5) for stack in STACKS},
        "runs": [
            {"stack": stack, "seconds": r["seconds"], "tokens": r["tokens"]}
            for stack in STACKS
            for r in runs[stack]
        ],
    }


def print_report(result: dict[str, Any], console: Console) -> None:
    rows = [
        (
            stack,
            f"{result['tokens_per_second'][stack]:.1f}",
            f"{result['per_token_latency_ms'][stack]['p50']:.2f}",
            f"{result['per_token_latency_ms'][stack]['p99']:.2f}",
            f"{result['ttft_ms_p50'][stack]:.1f}",
        )
        for stack in STACKS
    ]
    print_table(
        console,
        f"TLS overhead, {result['model']} ({result['dtype']}), "
        f"{result['requests']} × {result['max_tokens']} tokens, {result['rounds']} rounds",
        ("stack", "tokens/s (median)", "per-token p50 ms", "per-token p99 ms", "TTFT p50 ms"),
        rows,
    )
    console.print(f"tls / plaintext = {result['tls_vs_plaintext_ratio']:.3f} (target >= 0.97)")


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
