"""`spotinfer demo`: a local cluster answers real prompts through a spot preemption.

The cluster runs on embedded defaults (its own redis-server, a coordinator, an active worker
and a warm standby, each with its daemon and an AWS-format metadata server). Mid-generation
the active worker's metadata server announces a spot termination, exactly as EC2 would; the
answers migrate to the standby. The report is the `notice` drill's verdict on every
invariant, the answers, and a timeline PNG.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from common.errors import UserError

DEMO_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step.",
    "Describe a walk through a busy market in the morning.",
    "Give a detailed plan for learning to play the guitar in three months.",
    "What is the capital of France? Tell me about its history.",
    "Write a letter to a friend about a trip to the mountains.",
)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "demo", help="a local cluster answers real prompts through a spot preemption"
    )
    parser.add_argument("--model", default="smollm2-135m", help="model folder or name")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--cloud", choices=("aws", "gcp", "azure"), default="aws")
    parser.add_argument("--out", type=Path, default=Path("demo-out"), help="report folder")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.panel import Panel
    from transformers import AutoTokenizer

    from protos.spotinfer.v1 import common_pb2
    from spotinfer.drills.report import verdict_table
    from spotinfer.drills.runner import DrillOptions, run_drill
    from spotinfer.loadgen import PlannedRequest
    from spotinfer.local.cluster import ClusterConfig, LocalCluster
    from spotinfer.models.smollm2 import resolve_model

    console = Console()
    model = str(resolve_model(args.model))
    if not Path(model, "config.json").exists():
        raise UserError(f"model {args.model!r}: no such model folder (need config.json)")
    tokenizer = AutoTokenizer.from_pretrained(model)
    stamp = int(time.time())
    planned = []
    for i, prompt in enumerate(DEMO_PROMPTS):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        planned.append(
            PlannedRequest(
                request_id=f"demo-{stamp}-{i}",
                send_offset_seconds=0.0,
                prompt_token_ids=tuple(tokenizer.encode(text, add_special_tokens=False)),
                max_tokens=args.max_tokens,
                sla_class=common_pb2.SLA_CLASS_INTERACTIVE,
            )
        )
    args.out.mkdir(parents=True, exist_ok=True)
    # float32: on CPU, bf16 kernels depend on the batch size, and the verdict compares the
    # answers token for token with an uninterrupted run.
    config = ClusterConfig(
        model=model,
        workers=1,
        standbys=1,
        cloud=args.cloud,
        dtype="float32",
        max_model_len=2048,
        memory_gib=2.0,
        coordinator_flags=("--record-retention-seconds", "1"),
        log_dir=args.out / "logs",
    )
    options = DrillOptions(scenario="notice", requests=len(planned), ignore_eos=False)
    with console.status("starting a local cluster (redis, coordinator, 2 workers + daemons) ..."):
        cluster = LocalCluster(config, console.print).start()
    try:
        console.print(
            f"sending {len(planned)} prompts; a {args.cloud.upper()} spot termination notice "
            "reaches the active worker mid-generation"
        )
        outcome = run_drill(
            cluster, options, planned, png=args.out / "timeline.png", say=console.print
        )
    finally:
        with console.status("stopping the cluster ..."):
            cluster.stop()

    traces = {t.request_id: t for t in outcome.traces}
    for prompt, plan in zip(DEMO_PROMPTS, planned, strict=True):
        trace = traces[plan.request_id]
        answer = str(tokenizer.decode(trace.token_ids, skip_special_tokens=True)).strip()
        moved = ", ".join(
            f"{e.kind} {e.from_worker}→{e.to_worker} (loaded {e.loaded_tokens}, "
            f"recomputed {e.recomputed_tokens})"
            for e in trace.events
            if e.kind in ("migrated", "recovered")
        )
        console.print(Panel(answer, title=prompt, subtitle=moved or "not interrupted"))
    report = outcome.report
    console.print(verdict_table(report))
    console.print(
        f"{report.requests} requests, {report.migrations} migrated, recomputed tokens "
        f"{report.recomputed_tokens}, p50 {report.p50_ms:.0f} ms, p99 {report.p99_ms:.0f} ms"
    )
    report.write_json(args.out / "report.json")
    console.print(f"report: {args.out / 'report.json'}; timeline: {outcome.png}")
    return 0 if report.verdict == "PASS" else 1
