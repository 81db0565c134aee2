"""`spotinfer rehearse`: the Terraform fleet's boot scripts and units, run on this machine.

Each VM is a network namespace (root and `ip netns` needed): Redis with TLS and AUTH, the
coordinator, N nodes booted by the rendered boot script, a client. The rehearsal streams
requests from the client VM, optionally gives one node a termination notice mid-stream,
and prints the verdict; everything it made is gone when it ends.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from common.errors import UserError


def register(subparsers: Any) -> None:
    rehearse: argparse.ArgumentParser = subparsers.add_parser(
        "rehearse",
        help="boot the Terraform fleet's units in network namespaces and stream through it",
    )
    rehearse.add_argument(
        "--model", default="tiny", help="model folder, or 'tiny' (built into the work folder)"
    )
    rehearse.add_argument("--cloud", choices=("aws", "gcp"), default="aws")
    rehearse.add_argument("--nodes", type=int, default=2, help="worker VMs")
    rehearse.add_argument("--requests", type=int, default=8)
    rehearse.add_argument("--output-tokens", default="48,64", help="range low,high")
    rehearse.add_argument(
        "--notice",
        action="store_true",
        help="a termination notice on the busiest node, a third of the way through (give "
        "it long, many streams: --requests 32 --output-tokens 940,960)",
    )
    rehearse.add_argument(
        "--memory-gib", type=float, default=0.5, help="per worker (weights + KV + reserve)"
    )
    rehearse.add_argument("--workdir", type=Path, default=None, help="default: a temp dir")
    rehearse.set_defaults(func=run_rehearse)


def _model(name: str, workdir: Path) -> Path:
    if name == "tiny":
        from spotinfer.models.tiny import build_tiny_llama

        return build_tiny_llama(workdir / "tiny-model")
    folder = Path(name).expanduser()
    if not (folder / "config.json").exists():
        raise UserError(f"--model {name!r}: no model folder there (need config.json)")
    return folder


def run_rehearse(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from spotinfer.rehearsal.fleet import SMALL_WORKER, Rehearsal, RehearsalConfig
    from spotinfer.rehearsal.netns import unavailable_reason
    from spotinfer.rehearsal.streams import plan, verdict

    reason = unavailable_reason()
    if reason:
        raise UserError(reason)
    try:
        low, high = (int(v) for v in args.output_tokens.split(","))
    except ValueError as exc:
        raise UserError(f"--output-tokens must be low,high, got {args.output_tokens!r}") from exc
    console = Console()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="spotinfer-rehearsal-"))
    model = _model(args.model, workdir)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    config = RehearsalConfig(
        model=model,
        workdir=workdir,
        cloud=args.cloud,
        nodes=args.nodes,
        worker_environment={**SMALL_WORKER, "SPOTINFER_MEMORY_GIB": str(args.memory_gib)},
    )
    started = time.monotonic()
    with console.status("booting Redis, the coordinator and the nodes ..."):
        fleet = Rehearsal(config).__enter__()
    try:
        with console.status("waiting for the nodes to register ..."):
            fleet.wait_registered()
        console.print(
            f"{len(fleet.nodes)} node(s) registered {time.monotonic() - started:.0f} s after "
            f"boot: {', '.join(vm.worker_id for vm in fleet.nodes)}"
        )
        planned = plan(args.requests, f"rehearse-{int(time.time())}", vocab, (low, high))
        with Progress(console=console) as progress:
            task = progress.add_task("streams from the client VM", total=len(planned))
            streams = fleet.streams(planned, on_done=lambda _: progress.advance(task)).start()
            if args.notice:
                _notice_mid_stream(fleet, streams, console)
            traces = streams.join()
        with console.status("greedy reference on one worker ..."):
            result = verdict(traces, fleet.greedy_reference(planned))
    finally:
        with console.status("removing every VM and process ..."):
            fleet.__exit__(None, None, None)
    console.print(
        f"{result.requests} stream(s): {len(result.lost)} lost, {result.duplicates} duplicate "
        f"and {result.gaps} missing token(s), {len(result.mismatches)} differing from greedy, "
        f"{result.migrations} migration(s), {result.recomputed_tokens} token(s) recomputed"
    )
    problems = result.problems(zero_recompute=args.notice)
    for problem in problems:
        console.print(f"[red]FAIL[/] {problem}")
    if not problems:
        console.print("[green]PASS[/]")
    return 1 if problems else 0


def _notice_mid_stream(fleet: Any, streams: Any, console: Any) -> None:
    """A third of the way through the planned tokens, the busiest node's metadata service
    announces its termination."""
    third = sum(p.max_tokens for p in streams.planned) // 3
    deadline = time.monotonic() + 120
    while streams.tokens_so_far() < third and time.monotonic() < deadline:
        time.sleep(0.02)
    counts: dict[str, int] = {}
    for trace in streams.live:
        if trace.token_workers and not trace.finish_reason:
            counts[trace.token_workers[-1]] = counts.get(trace.token_workers[-1], 0) + 1
    if not counts:
        console.print("no stream in flight to notice; skipping the notice")
        return
    target = fleet.node_named(max(counts, key=lambda worker: counts[worker]))
    console.print(f"termination notice on {target.worker_id} ({target.name})")
    fleet.notice(target)
