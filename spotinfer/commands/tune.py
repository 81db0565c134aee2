"""`spotinfer tune`: sweep max_num_seqs and request rates on a model, pick one per SLA class."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common.errors import UserError


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "tune", help="sweep batch sizes and request rates; recommend max_num_seqs per SLA class"
    )
    parser.add_argument("--model", default="smollm2-135m", help="model folder or name")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", help="max_num_seqs values")
    parser.add_argument("--rates", default="0,4", help="requests/s; 0 sends a point's all at once")
    parser.add_argument("--requests", type=int, default=16, help="least requests per point")
    parser.add_argument("--prompt-tokens", default="64,128", help="range low,high")
    parser.add_argument("--output-tokens", default="48,48", help="range low,high")
    parser.add_argument("--interactive-ttft-p99-ms", type=float, default=2000.0)
    parser.add_argument("--interactive-tpot-p99-ms", type=float, default=150.0)
    parser.add_argument("--batch-ttft-p99-ms", type=float, default=float("inf"))
    parser.add_argument("--batch-tpot-p99-ms", type=float, default=float("inf"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--watts-per-core", type=float, default=4.0, help="CPU energy estimate")
    parser.add_argument(
        "--energy-source",
        choices=("auto", "nvml", "estimate"),
        default="auto",
        help="nvml: the GPU's energy counter (an error where NVML cannot measure); estimate: "
        "CPU time x --watts-per-core; auto: nvml where it can measure, else the estimate",
    )
    parser.add_argument("--json", type=Path, default=Path("tune.json"))
    parser.add_argument("--png", type=Path, default=Path("tune.png"))
    parser.add_argument("--apply", type=Path, default=None, help="write the tuning file here")
    parser.set_defaults(func=run)


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise UserError(f"--{name} must be comma-separated integers, got {text!r}") from exc
    if not values:
        raise UserError(f"--{name} is empty")
    return values


def _range(text: str, name: str) -> tuple[int, int]:
    values = _ints(text, name)
    if len(values) != 2:
        raise UserError(f"--{name} must be two integers low,high, got {text!r}")
    return values[0], values[1]


class _Worker:
    """Adapts a worker process to what the tuner needs."""

    def __init__(self, process: Any, watts_per_core: float, energy_source: str) -> None:
        self._process = process
        self._watts = watts_per_core
        self._energy_source = energy_source
        self.address = process.address

    def stats(self) -> Any:
        from protos.spotinfer.v1 import worker_pb2

        return self._process.stub.Stats(worker_pb2.StatsRequest(), timeout=5)

    def energy_meter(self) -> Any:
        from worker.energy import meter_for

        return meter_for(self._process.process.pid, self._watts, self._energy_source)


def _check_energy_source(source: str) -> None:
    """``--energy-source nvml`` where NVML cannot measure stops before any worker starts."""
    if source != "nvml":
        return
    from worker.energy import open_nvml

    meter, reason = open_nvml()
    if meter is None:
        raise UserError(f"--energy-source nvml: {reason}")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from spotinfer.local.worker_process import WorkerProcess
    from spotinfer.models.smollm2 import resolve_model
    from spotinfer.tuner import (
        SlaTargets,
        TuneConfig,
        Tuner,
        energy_label,
        iter_rows,
        plot,
        recommend,
        result_json,
        tuning_file,
    )

    try:
        config = TuneConfig(
            batch_sizes=_ints(args.batch_sizes, "batch-sizes"),
            rates_per_second=tuple(float(v) for v in args.rates.split(",") if v.strip()),
            min_requests_per_point=args.requests,
            prompt_tokens=_range(args.prompt_tokens, "prompt-tokens"),
            output_tokens=_range(args.output_tokens, "output-tokens"),
            interactive=SlaTargets(args.interactive_ttft_p99_ms, args.interactive_tpot_p99_ms),
            batch=SlaTargets(args.batch_ttft_p99_ms, args.batch_tpot_p99_ms),
        )
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    _check_energy_source(args.energy_source)
    model = str(resolve_model(args.model))
    if not Path(model, "config.json").exists():
        raise UserError(f"{model} is not a model folder (no config.json)")
    vocab = int(json.loads(Path(model, "config.json").read_text())["vocab_size"])

    @contextmanager
    def launch(batch_size: int) -> Iterator[_Worker]:
        flags = (
            *("--dtype", args.dtype),
            *("--max-model-len", str(args.max_model_len)),
            *("--kv-cache-bytes", str(int(args.kv_cache_gib * 2**30))),
            *("--max-num-seqs", str(batch_size)),
        )
        with WorkerProcess(model, *flags) as process:
            yield _Worker(process, args.watts_per_core, args.energy_source)

    console = Console()
    total = len(config.batch_sizes) * len(config.rates_per_second)
    with Progress(console=console) as progress:
        task = progress.add_task("sweeping", total=total)

        def on_point(point: Any) -> None:
            progress.update(
                task,
                advance=1,
                description=f"max_num_seqs {point.max_num_seqs}: "
                f"{point.summary.tokens_per_second:.0f} tok/s",
            )

        points = Tuner(config, launch, vocab_high=vocab, on_point=on_point).run()
    choices = recommend(points, config)

    table = Table(title=f"spotinfer tune — {Path(model).name} ({args.dtype})")
    for column in (
        "max_num_seqs",
        "req/s",
        "done",
        "tokens/s",
        "TTFT p50/p99 ms",
        "TPOT p50/p99 ms",
        "KV free (min)",
        f"J/token ({energy_label(points)})",
    ):
        table.add_column(column)
    for row in iter_rows(points):
        table.add_row(*row)
    console.print(table)
    details = sorted({p.energy_detail for p in points if p.energy_detail})
    console.print(f"energy per token: {energy_label(points)} — " + "; ".join(details))
    for choice in choices:
        if choice.point is None:
            console.print(f"[bold]{choice.sla_class}[/]: {choice.reason}")
        else:
            console.print(
                f"[bold]{choice.sla_class}[/]: max_num_seqs {choice.point.max_num_seqs} "
                f"({choice.point.summary.tokens_per_second:.0f} tokens/s) — {choice.reason}"
            )
    args.json.write_text(json.dumps(result_json(points, choices, model), indent=2))
    console.print(f"JSON: {args.json}")
    console.print(f"plot: {plot(points, choices, args.png, model)}")
    if args.apply is not None:
        args.apply.write_text(json.dumps(tuning_file(choices, model), indent=2))
        console.print(f"tuning file: {args.apply}")
    return 0
