"""Tokens/s through `Worker.Generate` over gRPC vs vLLM's offline `LLM.generate`, side by side.

    python -m benchmarks.worker_throughput [--model smollm2-135m] [--rounds 3]

Same model, same requests (16 × 128 output tokens, greedy, EOS ignored), alternating rounds
so that machine noise hits both sides alike. Also the time to first token that the gRPC
worker adds over an in-process `AsyncLLM` given the same 16 concurrent requests.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from rich.console import Console
from rich.progress import Progress

from benchmarks.baseline_engine import RESULT_PREFIX
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
from spotinfer.local.worker_process import REPO_ROOT, WorkerProcess, process_environment

KV_CACHE_BYTES = 1 << 30
MAX_MODEL_LEN = 2048
SINGLE_REQUEST_SAMPLES = 20


def _engine_kwargs(dtype: str) -> dict[str, Any]:
    return {
        "dtype": dtype,
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "max_num_seqs": 64,
    }


class BaselineEngine:
    """The baseline process (`benchmarks.baseline_engine`), one command at a time."""

    def __init__(self, model: str, dtype: str) -> None:
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.baseline_engine",
                model,
                json.dumps(_engine_kwargs(dtype)),
            ],
            cwd=REPO_ROOT,
            env=process_environment(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            if line.startswith(RESULT_PREFIX):
                result: dict[str, Any] = json.loads(line[len(RESULT_PREFIX) :])
                return result
        raise RuntimeError("the baseline engine exited")

    def run(self, mode: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        assert self._process.stdin is not None
        command = {"mode": mode, "prompts": prompts, "max_tokens": max_tokens}
        self._process.stdin.write(json.dumps(command) + "\n")
        self._process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.write(json.dumps({"mode": "quit"}) + "\n")
            self._process.stdin.flush()
            try:
                self._process.wait(60)
            except subprocess.TimeoutExpired:
                self._process.kill()


def run_grpc(worker: WorkerProcess, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from protos.spotinfer.v1 import common_pb2

    ttft_ms: list[float] = []
    counts: list[int] = []
    lock = threading.Lock()

    def one(ids: list[int]) -> None:
        request = common_pb2.GenerateRequest(
            prompt_token_ids=ids,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        start = time.perf_counter()
        first: float | None = None
        n = 0
        for response in worker.stub.Generate(request, timeout=600):
            if first is None and response.token_ids:
                first = (time.perf_counter() - start) * 1000
            n += len(response.token_ids)
        with lock:
            ttft_ms.append(first or 0.0)
            counts.append(n)

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"seconds": time.perf_counter() - start, "tokens": sum(counts), "ttft_ms": ttft_ms}


def measure(model: str, requests: int, max_tokens: int, rounds: int, dtype: str) -> dict[str, Any]:
    prompts = prompt_ids(model, requests)
    kwargs = _engine_kwargs(dtype)
    flags = engine_flags(
        dtype, kwargs["max_model_len"], kwargs["kv_cache_memory_bytes"], kwargs["max_num_seqs"]
    )
    runs: dict[str, list[dict[str, Any]]] = {
        "offline": [],
        "async": [],
        "grpc": [],
        "single_async": [],
        "single_grpc": [],
    }
    with Progress() as progress:
        task = progress.add_task("loading engines", total=rounds * 3 + 1)
        baseline = BaselineEngine(model, dtype)
        worker = WorkerProcess(model, *flags).start()
        try:
            # Warm-up: the first run of each pays one-off costs.
            baseline.run("offline", prompts[:2], 8)
            baseline.run("async", prompts[:2], 8)
            run_grpc(worker, prompts[:2], 8)
            progress.update(task, advance=1, description="measuring")
            for _, mode in alternating(("offline", "grpc", "async"), rounds):
                if mode == "grpc":
                    runs[mode].append(run_grpc(worker, prompts, max_tokens))
                else:
                    runs[mode].append(baseline.run(mode, prompts, max_tokens))
                progress.update(task, advance=1)
            # TTFT of a lone request isolates what the gRPC hop adds from batching effects.
            progress.update(task, description="single-request TTFT")
            for i in range(SINGLE_REQUEST_SAMPLES):
                prompt = [prompts[i % len(prompts)]]
                runs["single_async"].append(baseline.run("async", prompt, 1))
                runs["single_grpc"].append(run_grpc(worker, prompt, 1))
        finally:
            baseline.close()
            worker.stop()
    return summarize(runs, model, requests, max_tokens, dtype)


def summarize(
    runs: dict[str, list[dict[str, Any]]], model: str, requests: int, max_tokens: int, dtype: str
) -> dict[str, Any]:
    def tps(mode: str) -> float:
        return statistics.median(r["tokens"] / r["seconds"] for r in runs[mode])

    def ttft(mode: str, q: float) -> float:
        return percentile([v for r in runs[mode] for v in r["ttft_ms"]], q)

    return {
        "model": model,
        "dtype": dtype,
        "requests": requests,
        "max_tokens": max_tokens,
        "rounds": len(runs["grpc"]),
        "tokens_per_second": {mode: tps(mode) for mode in ("offline", "async", "grpc")},
        "grpc_vs_offline_ratio": tps("grpc") / tps("offline"),
        "grpc_vs_async_ratio": tps("grpc") / tps("async"),
        "ttft_ms_p50": {"async": ttft("async", 0.5), "grpc": ttft("grpc", 0.5)},
        "ttft_ms_p99": {"async": ttft("async", 0.99), "grpc": ttft("grpc", 0.99)},
        "grpc_added_ttft_ms_p50": ttft("grpc", 0.5) - ttft("async", 0.5),
        "single_request_ttft_ms_p50": {
            "async": ttft("single_async", 0.5),
            "grpc": ttft("single_grpc", 0.5),
        },
        "grpc_added_single_ttft_ms_p50": ttft("single_grpc", 0.5) - ttft("single_async", 0.5),
        "runs": runs,
    }


def print_report(result: dict[str, Any], console: Console) -> None:
    tps = result["tokens_per_second"]

    def timed(label: str, mode: str) -> tuple[str, ...]:
        return (
            label,
            f"{tps[mode]:.1f}",
            f"{result['ttft_ms_p50'][mode]:.1f}",
            f"{result['ttft_ms_p99'][mode]:.1f}",
        )

    print_table(
        console,
        f"Worker throughput, {result['model']} ({result['dtype']})",
        ("path", "tokens/s (median)", "TTFT p50 ms", "TTFT p99 ms"),
        [
            ("vLLM LLM.generate (offline)", f"{tps['offline']:.1f}", "-", "-"),
            timed("vLLM AsyncLLM in-process", "async"),
            timed("spotinfer Worker.Generate (gRPC)", "grpc"),
        ],
    )
    console.print(
        f"gRPC / offline = {result['grpc_vs_offline_ratio']:.3f}; "
        f"gRPC / AsyncLLM = {result['grpc_vs_async_ratio']:.3f}; "
        f"TTFT added by gRPC (p50) = {result['grpc_added_ttft_ms_p50']:.1f} ms at "
        f"{result['requests']} concurrent, "
        f"{result['grpc_added_single_ttft_ms_p50']:.1f} ms for a lone request "
        f"({result['single_request_ttft_ms_p50']['grpc']:.1f} vs "
        f"{result['single_request_ttft_ms_p50']['async']:.1f} ms)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, rounds=3, dtype="bfloat16")
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
