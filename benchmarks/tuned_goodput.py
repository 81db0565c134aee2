"""Goodput under an interactive SLA: the tuned max_num_seqs vs vLLM's default vs the adaptive
batch controller, same arrivals.

    python -m benchmarks.tuned_goodput --tuning-file docs/bench/tuning.json --adaptive

Workers on the same model stay loaded side by side — one with the interactive class's tuned
max_num_seqs, one with vLLM's default for an API server on this platform (128 on CPU, 256 on
GPU) — and receive the same seeded Poisson arrivals in alternating rounds, sent to the
worker itself. With ``--adaptive`` a third side runs: a worker at vLLM's default behind a
coordinator whose batch controller starts from the tuned cap (`--tuning-file`, else
`--tuned-max-num-seqs`) and moves it against the same targets; its load goes through the
coordinator (the relay adds well under a millisecond per token, see relay_overhead). The
controller keeps what it learnt from one round to the next, as a running cluster does.
Goodput is the rate of requests that finished within both the TTFT and the TPOT targets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from benchmarks.harness import (
    alternating,
    benchmark_parser,
    engine_flags,
    print_table,
    resolve_model_arg,
    write_json,
)
from benchmarks.relay_overhead import _wait_routable
from common.tuning_file import load_tuning_file
from protos.spotinfer.v1 import common_pb2, control_pb2
from spotinfer.loadgen import LoadSpec, goodput, plan_requests, run_load, summarize
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.worker_process import WorkerProcess

VLLM_CPU_DEFAULT_MAX_NUM_SEQS = 128


def _worker(model: str, max_num_seqs: int, dtype: str) -> WorkerProcess:
    return WorkerProcess(model, *engine_flags(dtype, 1024, 2 << 30, max_num_seqs))


def _controller_flags(args: argparse.Namespace, model: str, tuned: int) -> tuple[str, ...]:
    """The adaptive side's coordinator: the batch controller on, from the tuned cap, against
    the benchmark's own targets."""
    start = (
        ("--tuning-file", str(args.tuning_file))
        if args.tuning_file is not None and args.tuned_max_num_seqs is None
        else ("--interactive-max-per-worker", str(tuned))
    )
    return (
        *("--model", model),
        *start,
        "--batch-controller",
        *("--batch-controller-interactive-ttft-slo-ms", f"{args.ttft_p99_ms:g}"),
        *("--batch-controller-interactive-tpot-slo-ms", f"{args.tpot_p99_ms:g}"),
    )


def measure(args: argparse.Namespace, model: str, tuned: int) -> dict[str, Any]:
    vocab = int(json.loads(Path(model, "config.json").read_text())["vocab_size"])
    settings = {"tuned": tuned, "vllm-default": args.default_max_num_seqs}
    if args.adaptive:
        settings["adaptive"] = args.default_max_num_seqs
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in settings}
    coordinator: CoordinatorProcess | None = None
    with Progress() as progress:
        task = progress.add_task("loading workers", total=args.rounds * len(settings))
        workers = {
            name: _worker(model, seqs, args.dtype).start() for name, seqs in settings.items()
        }
        targets = {name: (w.address, "worker") for name, w in workers.items()}
        try:
            if args.adaptive:
                coordinator = CoordinatorProcess(
                    *("--worker", workers["adaptive"].address),
                    *_controller_flags(args, model, tuned),
                ).start()
                _wait_routable(coordinator)
                targets["adaptive"] = (coordinator.address, "inference")
            for r, name in alternating(list(settings), args.rounds):
                spec = LoadSpec(
                    num_requests=args.requests,
                    rate_per_second=args.rate,
                    prompt_tokens=(64, 128),
                    output_tokens=tuple(args.output_tokens),  # type: ignore[arg-type]
                    vocab_high=vocab,
                    seed=r,
                )
                progress.update(task, description=f"round {r + 1}: {name}")
                planned = plan_requests(spec, prefix=f"goodput-{name}-{r}")
                address, service = targets[name]
                traces = asyncio.run(run_load(address, planned, service=service))
                summary = summarize(traces)
                rounds[name].append(
                    {
                        "goodput_rps": goodput(traces, args.ttft_p99_ms, args.tpot_p99_ms),
                        "tokens_per_second": summary.tokens_per_second,
                        "ttft_ms_p99": summary.ttft_ms_p99,
                        "tpot_ms_p99": summary.tpot_ms_p99,
                        "completed": summary.completed,
                    }
                )
                if name == "adaptive" and coordinator is not None:
                    rounds[name][-1]["interactive_cap_after"] = _interactive_cap(coordinator)
                progress.update(task, advance=1)
        finally:
            if coordinator is not None:
                coordinator.stop()
            for worker in workers.values():
                worker.stop()

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds[name])

    result = {
        "model": model,
        "settings": settings,
        "rate_per_second": args.rate,
        "requests_per_round": args.requests,
        "output_tokens": args.output_tokens,
        "sla": {"ttft_p99_ms": args.ttft_p99_ms, "tpot_p99_ms": args.tpot_p99_ms},
        "median": {name: {key: med(name, key) for key in rounds[name][0]} for name in settings},
        "goodput_ratio_tuned_vs_default": med("tuned", "goodput_rps")
        / max(med("vllm-default", "goodput_rps"), 1e-9),
        "rounds": rounds,
    }
    if args.adaptive:
        best = max(med("tuned", "goodput_rps"), med("vllm-default", "goodput_rps"))
        result["goodput_ratio_adaptive_vs_best_static"] = med("adaptive", "goodput_rps") / max(
            best, 1e-9
        )
    return result


def _interactive_cap(coordinator: CoordinatorProcess) -> float:
    """The INTERACTIVE cap the batch controller holds on the adaptive side's worker now."""
    status = coordinator.control.ClusterStatus(control_pb2.ClusterStatusRequest(), timeout=10)
    for worker in status.workers:
        for cap in worker.admission_caps:
            if cap.sla_class == common_pb2.SLA_CLASS_INTERACTIVE:
                return float(cap.cap)
    return 0.0


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, rounds=2, dtype="bfloat16")
    parser.add_argument("--tuning-file", type=Path, default=None)
    parser.add_argument("--tuned-max-num-seqs", type=int, default=None)
    parser.add_argument("--default-max-num-seqs", type=int, default=VLLM_CPU_DEFAULT_MAX_NUM_SEQS)
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s (Poisson)")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument(
        "--output-tokens",
        type=lambda text: [int(v) for v in text.split(",")],
        default=[48, 96],
        help="output length range low,high (48,48: the load the tuner swept)",
    )
    parser.add_argument(
        "--adaptive", action="store_true", help="also run the batch controller's side"
    )
    parser.add_argument("--ttft-p99-ms", type=float, default=2000.0)
    parser.add_argument("--tpot-p99-ms", type=float, default=150.0)
    args = parser.parse_args(argv)
    if args.tuned_max_num_seqs is not None:
        tuned = args.tuned_max_num_seqs
    elif args.tuning_file is not None:
        tuned = load_tuning_file(args.tuning_file)["classes"]["interactive"]["max_num_seqs"]
    else:
        parser.error("give --tuning-file or --tuned-max-num-seqs")
    model = resolve_model_arg(args.model)
    result = measure(args, model, tuned)
    rows = []
    for name, seqs in result["settings"].items():
        m = result["median"][name]
        rows.append(
            (
                name,
                str(seqs),
                f"{m['goodput_rps']:.2f}",
                f"{m['tokens_per_second']:.1f}",
                f"{m['ttft_ms_p99']:.0f}",
                f"{m['tpot_ms_p99']:.1f}",
            )
        )
    console = Console()
    print_table(
        console,
        f"goodput under TTFT p99 ≤ {args.ttft_p99_ms:g} ms, TPOT p99 ≤ {args.tpot_p99_ms:g} ms",
        ("setting", "max_num_seqs", "goodput req/s", "tokens/s", "TTFT p99 ms", "TPOT p99 ms"),
        rows,
    )
    console.print(f"goodput tuned / default = {result['goodput_ratio_tuned_vs_default']:.2f}")
    if args.adaptive:
        ratio = result["goodput_ratio_adaptive_vs_best_static"]
        caps = [r.get("interactive_cap_after", 0) for r in result["rounds"]["adaptive"]]
        console.print(f"goodput adaptive / best static = {ratio:.2f}; interactive cap {caps}")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
