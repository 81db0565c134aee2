"""Interactive latency under a full batch job: vLLM priority scheduling on vs first come
first served, same arrivals.

    python -m benchmarks.priority_isolation --json docs/bench/priority_isolation.json

Two workers of the same size stay loaded side by side — `--scheduling-policy priority` (the
default) and `--scheduling-policy fcfs` — and get the same seeded load in alternating
rounds, sent to the worker itself (the engine's order is what is measured; a coordinator in
front would hold the batch work back in its own queues): a batch job of BATCH requests sent
all at once, more than the engine runs at a time, and INTERACTIVE requests arriving as a
Poisson stream while it runs. Per side: the interactive TTFT and TPOT p50 / p99, the batch
job's throughput, and, from the engine's own timestamps (`EngineTiming`), how many
interactive requests were scheduled after a batch request that was queued before them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
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
    percentile,
    print_table,
    resolve_model_arg,
    write_json,
)
from protos.spotinfer.v1 import common_pb2
from spotinfer.loadgen import LoadSpec, RequestTrace, plan_requests, run_load
from spotinfer.local.worker_process import WorkerProcess

POLICIES = ("priority", "fcfs")


def _planned(args: argparse.Namespace, vocab: int, seed: int, prefix: str) -> list[Any]:
    batch = plan_requests(
        LoadSpec(
            num_requests=args.batch_requests,
            rate_per_second=0,
            prompt_tokens=(64, 128),
            output_tokens=tuple(args.batch_output_tokens),  # type: ignore[arg-type]
            vocab_high=vocab,
            seed=seed,
        ),
        prefix=f"{prefix}-batch",
    )
    interactive = plan_requests(
        LoadSpec(
            num_requests=args.interactive_requests,
            rate_per_second=args.interactive_rate,
            prompt_tokens=(64, 128),
            output_tokens=tuple(args.interactive_output_tokens),  # type: ignore[arg-type]
            vocab_high=vocab,
            seed=seed + 1000,
        ),
        prefix=f"{prefix}-interactive",
    )
    return [
        *(dataclasses.replace(r, sla_class=common_pb2.SLA_CLASS_BATCH) for r in batch),
        *(
            dataclasses.replace(
                r,
                sla_class=common_pb2.SLA_CLASS_INTERACTIVE,
                send_offset_seconds=r.send_offset_seconds + args.interactive_start_seconds,
            )
            for r in interactive
        ),
    ]


def waited_behind_batch(traces: list[RequestTrace]) -> int:
    """INTERACTIVE requests the engine scheduled after a BATCH request queued before them."""
    batch = [
        t
        for t in traces
        if t.sla_class == common_pb2.SLA_CLASS_BATCH and t.engine_scheduled_at is not None
    ]
    count = 0
    for t in traces:
        if t.sla_class != common_pb2.SLA_CLASS_INTERACTIVE or t.engine_scheduled_at is None:
            continue
        queued = t.engine_queued_at or t.engine_scheduled_at
        if any(
            (b.engine_queued_at or 0.0) < queued < b.engine_scheduled_at < t.engine_scheduled_at  # type: ignore[operator]
            for b in batch
        ):
            count += 1
    return count


def _round_figures(traces: list[RequestTrace]) -> dict[str, float]:
    interactive = [t for t in traces if t.sla_class == common_pb2.SLA_CLASS_INTERACTIVE and t.ok]
    batch = [t for t in traces if t.sla_class == common_pb2.SLA_CLASS_BATCH and t.ok]
    ttft = [t.ttft_seconds * 1000 for t in interactive if t.ttft_seconds is not None]
    tpot = [t.tpot_seconds * 1000 for t in interactive if t.tpot_seconds is not None]
    start = min(t.sent_at for t in traces)
    batch_end = max((t.token_times[-1] for t in batch if t.token_times), default=start)
    batch_tokens = sum(len(t.token_ids) for t in batch)
    return {
        "interactive_ttft_ms_p50": percentile(ttft, 0.5),
        "interactive_ttft_ms_p99": percentile(ttft, 0.99),
        "interactive_tpot_ms_p50": percentile(tpot, 0.5),
        "interactive_tpot_ms_p99": percentile(tpot, 0.99),
        "batch_tokens_per_second": batch_tokens / max(batch_end - start, 1e-9),
        "batch_job_seconds": batch_end - start,
        "interactive_waited_behind_batch": float(waited_behind_batch(traces)),
        "interactive_completed": float(len(interactive)),
        "batch_completed": float(len(batch)),
    }


def measure(args: argparse.Namespace, model: str) -> dict[str, Any]:
    vocab = int(json.loads(Path(model, "config.json").read_text())["vocab_size"])
    rounds: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
    flags = engine_flags(args.dtype, 1024, 2 << 30, args.max_num_seqs)
    with Progress() as progress:
        task = progress.add_task("loading workers", total=args.rounds * len(POLICIES))
        workers = {
            p: WorkerProcess(model, *flags, "--scheduling-policy", p).start() for p in POLICIES
        }
        try:
            for r, policy in alternating(POLICIES, args.rounds):
                progress.update(task, description=f"round {r + 1}: {policy}")
                planned = _planned(args, vocab, r, f"prio-{policy}-{r}")
                traces = asyncio.run(run_load(workers[policy].address, planned, service="worker"))
                rounds[policy].append(_round_figures(traces))
                progress.update(task, advance=1)
        finally:
            for worker in workers.values():
                worker.stop()

    def med(policy: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds[policy])

    median = {p: {k: med(p, k) for k in rounds[p][0]} for p in POLICIES}
    return {
        "model": model,
        "max_num_seqs": args.max_num_seqs,
        "load": {
            "batch_requests": args.batch_requests,
            "batch_output_tokens": args.batch_output_tokens,
            "interactive_requests": args.interactive_requests,
            "interactive_rate_per_second": args.interactive_rate,
            "interactive_output_tokens": args.interactive_output_tokens,
            "interactive_start_seconds": args.interactive_start_seconds,
        },
        "median": median,
        "ttft_p99_ratio_fcfs_vs_priority": median["fcfs"]["interactive_ttft_ms_p99"]
        / max(median["priority"]["interactive_ttft_ms_p99"], 1e-9),
        "batch_throughput_ratio_priority_vs_fcfs": median["priority"]["batch_tokens_per_second"]
        / max(median["fcfs"]["batch_tokens_per_second"], 1e-9),
        "rounds": rounds,
    }


def _pair(text: str) -> list[int]:
    low, high = (int(v) for v in text.split(","))
    return [low, high]


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, rounds=2, dtype="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--batch-requests", type=int, default=48)
    parser.add_argument("--batch-output-tokens", type=_pair, default=[32, 160])
    parser.add_argument("--interactive-requests", type=int, default=16)
    parser.add_argument("--interactive-rate", type=float, default=1.0, help="requests/s")
    parser.add_argument("--interactive-output-tokens", type=_pair, default=[24, 48])
    parser.add_argument("--interactive-start-seconds", type=float, default=2.0)
    args = parser.parse_args(argv)
    result = measure(args, resolve_model_arg(args.model))
    rows = []
    for policy in POLICIES:
        m = result["median"][policy]
        rows.append(
            (
                policy,
                f"{m['interactive_ttft_ms_p50']:.0f} / {m['interactive_ttft_ms_p99']:.0f}",
                f"{m['interactive_tpot_ms_p50']:.1f} / {m['interactive_tpot_ms_p99']:.1f}",
                f"{m['interactive_waited_behind_batch']:.0f}/{args.interactive_requests}",
                f"{m['batch_tokens_per_second']:.1f}",
            )
        )
    console = Console()
    print_table(
        console,
        f"interactive under a batch job, max_num_seqs {args.max_num_seqs} (medians of rounds)",
        ("policy", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "waited behind batch", "batch tok/s"),
        rows,
    )
    console.print(
        f"TTFT p99 fcfs / priority = {result['ttft_p99_ratio_fcfs_vs_priority']:.2f}; "
        f"batch throughput priority / fcfs = "
        f"{result['batch_throughput_ratio_priority_vs_fcfs']:.2f}"
    )
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
