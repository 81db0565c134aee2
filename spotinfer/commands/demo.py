"""`spotinfer demo`: a worker on a real model answering real prompts, then a report.

What runs today: the demo model, one worker process (vLLM behind the Worker gRPC service),
a handful of chat prompts streamed concurrently, and a report of what the worker did. The
coordinator, the context daemon and the preemption drill join this command as they land.
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass, field
from typing import Any

DEMO_PROMPTS = (
    "What is the capital of France?",
    "Give me two tips for staying focused while studying.",
    "Explain in one sentence what a spot virtual machine is.",
    "Write a haiku about the sea.",
)


@dataclass
class _Answer:
    prompt: str
    text: str = ""
    tokens: int = 0
    ttft_ms: float = 0.0
    seconds: float = 0.0
    finish: str = ""
    indices_ok: bool = True
    chunks: list[int] = field(default_factory=list)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "demo", help="serve real prompts on the demo model and print a report"
    )
    parser.add_argument("--model", default="smollm2-135m", help="model folder or name")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.set_defaults(func=run)


def _ask(stub: Any, prompt_ids: list[int], answer: _Answer, max_tokens: int) -> None:
    from protos.spotinfer.v1 import common_pb2

    request = common_pb2.GenerateRequest(
        prompt_token_ids=prompt_ids,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
    )
    start = time.perf_counter()
    for response in stub.Generate(request, timeout=600):
        if response.token_ids and not answer.tokens:
            answer.ttft_ms = (time.perf_counter() - start) * 1000
        answer.indices_ok &= response.index == answer.tokens
        answer.tokens += len(response.token_ids)
        answer.text += response.text
        if response.finish_reason:
            answer.finish = common_pb2.FinishReason.Name(response.finish_reason)[14:].lower()
    answer.seconds = time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoTokenizer

    from protos.spotinfer.v1 import worker_pb2
    from spotinfer.errors import UserError
    from spotinfer.local.worker_process import WorkerProcess
    from spotinfer.models.smollm2 import resolve_model

    console = Console()
    model = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model)
    console.print(f"[bold]model[/] {model}")
    with console.status("starting a worker (vLLM engine) ..."):
        try:
            worker = WorkerProcess(
                model, "--dtype", "float32", "--max-model-len", "2048", "--memory-gib", "2"
            ).start()
        except (RuntimeError, TimeoutError) as exc:
            raise UserError(f"the worker did not start: {str(exc)[-500:]}") from exc
    try:
        answers = [_Answer(p) for p in DEMO_PROMPTS]
        threads = []
        for answer in answers:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": answer.prompt}],
                add_generation_prompt=True,
                tokenize=False,
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
            threads.append(
                threading.Thread(
                    target=_ask, args=(worker.stub, list(ids), answer, args.max_tokens)
                )
            )
        with console.status(f"generating {len(answers)} answers concurrently ..."):
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        stats = worker.stub.Stats(worker_pb2.StatsRequest(), timeout=10)
    finally:
        worker.stop()

    for answer in answers:
        console.print(
            f"\n[bold cyan]Q:[/] {answer.prompt}\n[bold green]A:[/] {answer.text.strip()}"
        )
    table = Table(title="spotinfer demo report")
    for column in ("prompt", "tokens", "TTFT ms", "tokens/s", "finish", "indices 0..n-1"):
        table.add_column(column)
    for answer in answers:
        table.add_row(
            answer.prompt[:40],
            str(answer.tokens),
            f"{answer.ttft_ms:.0f}",
            f"{answer.tokens / max(answer.seconds, 1e-9):.1f}",
            answer.finish,
            "PASS" if answer.indices_ok else "FAIL",
        )
    console.print(table)
    console.print(
        f"worker {stats.worker_id}: {stats.kv_blocks_total} KV blocks of {stats.kv_block_tokens} "
        f"tokens, max_num_seqs {stats.max_num_seqs}, {stats.generated_tokens_total} tokens "
        f"generated"
    )
    return 0 if all(a.indices_ok and a.tokens for a in answers) else 1
