"""`spotinfer plan`: how many sequences of a context length fit beside a model's weights."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from common.errors import UserError

BYTES_PER_GIB = 2**30


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan weights, KV cache and concurrency for a memory size",
        description=(
            "From a model's config.json and one device's memory, compute the weight bytes, "
            "the KV cache bytes per token, a 10%% activation reserve on top of weights and "
            "KV, and how many sequences of each context length fit at once."
        ),
    )
    # Numbers are parsed by the handler, not argparse, so a bad value is one error line.
    parser.add_argument(
        "--config", required=True, help="config.json, or a model folder that holds one"
    )
    parser.add_argument("--memory-gib", required=True, help="memory of one device, GiB")
    parser.add_argument("--context", required=True, help="tokens per sequence (prompt + output)")
    parser.add_argument("--dtype", default="bf16", help="weight dtype (default: bf16; 'auto')")
    parser.add_argument(
        "--quantization", default=None, help="weight quantization: fp8, int8 or int4"
    )
    parser.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: --dtype)")
    parser.add_argument("--tp", default="1", help="tensor parallel degree (default: 1)")
    parser.add_argument(
        "--block-tokens", default="16", help="KV block size in tokens (GPU 16, CPU 128)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run_plan)


def _positive_int(flag: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"{flag} must be a whole number, got {text!r}") from None
    if value <= 0:
        raise UserError(f"{flag} must be positive, got {value}")
    return value


def _memory_bytes(text: str) -> int:
    try:
        gib = float(text)
    except ValueError:
        raise UserError(f"--memory-gib must be a number, got {text!r}") from None
    if not math.isfinite(gib) or gib <= 0:
        raise UserError(f"--memory-gib must be a positive number, got {text!r}")
    return int(gib * BYTES_PER_GIB)


def run_plan(args: argparse.Namespace) -> int:
    from worker.memory_planner import MemoryPlanError, plan_memory

    try:
        plan = plan_memory(
            Path(args.config).expanduser(),
            _memory_bytes(args.memory_gib),
            _positive_int("--context", args.context),
            dtype=args.dtype,
            quantization=args.quantization,
            kv_dtype=args.kv_dtype,
            tensor_parallel_size=_positive_int("--tp", args.tp),
            block_tokens=_positive_int("--block-tokens", args.block_tokens),
        )
    except MemoryPlanError as exc:
        raise UserError(str(exc)) from exc
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        _print_tables(plan)
    return 0


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / BYTES_PER_GIB:,.2f} GiB"


def _print_tables(plan: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    per_rank = " per rank" if plan.tensor_parallel_size > 1 else ""
    summary = Table(title=f"Memory plan{per_rank}", show_header=False)
    summary.add_column("quantity")
    summary.add_column("value", justify="right")
    summary.add_row("parameters", f"{plan.parameter_count:,}")
    summary.add_row(
        f"weights ({plan.weight_dtype}, tp={plan.tensor_parallel_size})", _gib(plan.weight_bytes)
    )
    summary.add_row(f"KV cache per token ({plan.kv_dtype})", f"{plan.kv_bytes_per_token:,} B")
    summary.add_row("memory", _gib(plan.memory_bytes))
    summary.add_row("activation reserve (10% of weights + KV)", _gib(plan.reserve_bytes))
    summary.add_row("KV cache budget", _gib(plan.kv_budget_bytes))
    summary.add_row(
        f"KV blocks ({plan.block_tokens} tokens, {plan.block_bytes:,} B each)",
        f"{plan.num_kv_blocks:,}",
    )
    summary.add_row(
        f"max concurrent sequences at {plan.context_tokens:,} tokens",
        f"{plan.max_concurrent_seqs:,}",
    )
    console = Console()
    console.print(summary)
    if plan.concurrency_by_context:
        by_context = Table(title="Max concurrent sequences by context length")
        by_context.add_column("context tokens", justify="right")
        by_context.add_column("sequences", justify="right")
        for context, seqs in plan.concurrency_by_context:
            by_context.add_row(f"{context:,}", f"{seqs:,}")
        console.print(by_context)
