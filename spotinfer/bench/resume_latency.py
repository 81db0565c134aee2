"""Resume latency (persisted KV loaded) vs full recompute (re-prefill), on a standby worker.

    python -m spotinfer.bench.resume_latency [--contexts 512,2048,4096] [--repeats 3]
                                             [--json OUT] [--plot OUT.png]

Real processes only: a redis-server started here on a free port, a standby worker B that stays
loaded, and for every sample a fresh worker A (SmolLM2-135M-Instruct, bfloat16, eager
persistence, max_model_len 4608, 1 GiB of KV cache each; vLLM's prefix caching off).

One sample at context C: A generates from a long prompt of real token ids (tokenized English
text, distinct per sample so no content-addressed block is shared with another sample) until
prompt + committed tokens reach the target length and every full block of it is in Redis;
then A is SIGKILLed. On B, in alternating order:

- ``resume``: time from the `Worker.Resume` call to the first NEW token (index = committed
  length) — what a client waits for; the RECOVERED event says how many context tokens B
  loaded and how many it recomputed;
- ``recompute``: time from a `Worker.Generate` of the same prompt + committed tokens (a fresh
  request id: nothing to load) to its first token — a full re-prefill, as a system without
  persisted KV does after a loss.

Two cases per context. ``abrupt``: the context is exactly C tokens, so the KV of C - 1 tokens
exists and its last block (127 tokens) is partial — not persisted under the eager policy — and
B recomputes those 127 tokens: the worst case of an abrupt loss. ``aligned``: the context is
C + 1 tokens, so the KV of exactly C tokens (C / 128 full blocks) is in Redis, and B loads it
all and computes only the last token, which every prefill computes anyway.

Medians over repeats; the machine is a shared 2-core box, so samples are interleaved
(repeat > context > case) and the two measurements of one sample alternate in order.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import redis
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from context_daemon.store import RedisStore, block_hashes
from spotinfer.bench.worker_throughput import PROMPTS
from spotinfer.local.redis_process import RedisProcess
from spotinfer.local.worker_process import WorkerProcess

BLOCK_TOKENS = 128  # vLLM-CPU's KV block size
MAX_MODEL_LEN = 4608
KV_CACHE_BYTES = 1 << 30
GENERATED_TOKENS = 32  # tokens A generates before it is lost (the rest of the context is prompt)
EXTRA_TOKENS = 64  # A's max_tokens beyond the target, so the request is still running at the kill
CASES = ("abrupt", "aligned")
POLL_SECONDS = 0.001
KILL_TIMEOUT_SECONDS = 300.0
IDLE_TIMEOUT_SECONDS = 60.0
STREAM_TIMEOUT_SECONDS = 600.0


def greedy(request_id: str, prompt: list[int], max_tokens: int) -> Any:
    from protos.spotinfer.v1 import common_pb2

    return common_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


class TextTokens:
    """Long runs of real token ids: the demo prompts in a shuffled order, tokenized."""

    def __init__(self, model: str) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(model)

    def prompt(self, length: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        ids: list[int] = []
        while len(ids) < length:
            texts = list(PROMPTS)
            rng.shuffle(texts)
            ids.extend(self._tokenizer.encode(" ".join(texts) + "\n"))
        return ids[:length]


class StreamReader:
    """Reads a worker's Generate stream on a thread while the benchmark watches Redis."""

    def __init__(self, stream: Iterator[Any]) -> None:
        self._stream = stream
        self.tokens: list[int] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self._stream:
                self.tokens.extend(response.token_ids)
        except grpc.RpcError:
            pass  # the worker was killed: the stream breaks

    def join(self) -> None:
        self._thread.join(STREAM_TIMEOUT_SECONDS)


def persist_then_kill(
    worker: WorkerProcess,
    store: RedisStore,
    fingerprint: str,
    request_id: str,
    prompt: list[int],
    target_generated: int,
) -> list[int]:
    """Generate on A until ``target_generated`` tokens are committed and every full block of
    the KV they imply is in Redis, SIGKILL A, and return the committed tokens."""
    reader = StreamReader(
        worker.stub.Generate(
            greedy(request_id, prompt, target_generated + EXTRA_TOKENS),
            timeout=STREAM_TIMEOUT_SECONDS,
        )
    )
    deadline = time.monotonic() + KILL_TIMEOUT_SECONDS
    needed: list[bytes] | None = None
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{request_id}: A never reached {target_generated} tokens")
        if needed is None and len(reader.tokens) >= target_generated:
            # KV exists for the prompt and every generated token but the last one.
            kv_tokens = prompt + reader.tokens[: target_generated - 1]
            needed = block_hashes(fingerprint, kv_tokens, BLOCK_TOKENS)
        if needed is not None:
            committed = store.get_request(request_id).committed_length
            if committed >= target_generated and all(store.blocks_present(needed)):
                worker.kill()
                break
        time.sleep(POLL_SECONDS)
    reader.join()
    return store.committed_tokens(request_id)


def time_resume(worker: WorkerProcess, request_id: str, from_index: int) -> dict[str, Any]:
    from protos.spotinfer.v1 import worker_pb2

    start = time.perf_counter()
    stream = worker.stub.Resume(
        worker_pb2.ResumeRequest(request_id=request_id, from_index=from_index),
        timeout=STREAM_TIMEOUT_SECONDS,
    )
    event: Any = None
    first_ms: float | None = None
    for response in stream:
        if response.HasField("event") and event is None:
            event = response.event
        if response.token_ids and response.index + len(response.token_ids) > from_index:
            first_ms = (time.perf_counter() - start) * 1000
            break
    stream.cancel()  # the rest of the request is not what this measures
    if event is None or first_ms is None:
        raise RuntimeError(f"{request_id}: Resume gave no RECOVERED event or no new token")
    return {
        "ms": first_ms,
        "loaded_tokens": event.loaded_tokens,
        "recomputed_tokens": event.recomputed_tokens,
        "detail": event.detail,
    }


def time_recompute(worker: WorkerProcess, request_id: str, context: list[int]) -> dict[str, Any]:
    start = time.perf_counter()
    for response in worker.stub.Generate(
        greedy(request_id, context, 1), timeout=STREAM_TIMEOUT_SECONDS
    ):
        if response.token_ids:
            return {"ms": (time.perf_counter() - start) * 1000}
    raise RuntimeError(f"{request_id}: no token came back")


def wait_idle(worker: WorkerProcess) -> None:
    """Until the cancelled resume has left B's engine (so the next timing runs alone)."""
    from protos.spotinfer.v1 import worker_pb2

    deadline = time.monotonic() + IDLE_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        stats = worker.stub.Stats(worker_pb2.StatsRequest(), timeout=10)
        if stats.running_seqs == 0 and stats.waiting_seqs == 0:
            return
        time.sleep(0.05)
    raise TimeoutError("the standby stayed busy")


def worker_flags(redis_url: str, worker_id: str) -> tuple[str, ...]:
    return (
        *("--dtype", "bfloat16"),
        *("--max-model-len", str(MAX_MODEL_LEN)),
        *("--kv-cache-bytes", str(KV_CACHE_BYTES)),
        *("--redis-url", redis_url),
        *("--kv-persist-policy", "eager"),
        *("--worker-id", worker_id),
    )


def one_sample(
    model: str,
    server: RedisProcess,
    admin: redis.Redis,
    store: RedisStore,
    standby: WorkerProcess,
    fingerprint: str,
    text: TextTokens,
    context: int,
    case: str,
    sample: int,
) -> dict[str, Any]:
    admin.flushall()  # nothing of an earlier sample can be loaded by this one
    prompt = text.prompt(context - GENERATED_TOKENS, seed=sample)
    target = GENERATED_TOKENS + (1 if case == "aligned" else 0)
    request_id = f"resume-{context}-{case}-{sample}"
    with WorkerProcess(model, *worker_flags(server.url, f"worker-a{sample}")) as worker_a:
        committed = persist_then_kill(worker_a, store, fingerprint, request_id, prompt, target)
    full_context = prompt + committed
    first_resume = sample % 2 == 0
    result: dict[str, Any] = {
        "context": context,
        "case": case,
        "sample": sample,
        "context_tokens": len(full_context),
        "committed_tokens": len(committed),
    }
    for measurement in ("resume", "recompute") if first_resume else ("recompute", "resume"):
        if measurement == "resume":
            result["resume"] = time_resume(standby, request_id, len(committed))
        else:
            result["recompute"] = time_recompute(standby, f"{request_id}-recompute", full_context)
        wait_idle(standby)
    return result


def measure(model: str, contexts: list[int], repeats: int, console: Console) -> dict[str, Any]:
    from worker.model_fingerprint import model_fingerprint

    fingerprint = model_fingerprint(model, "bfloat16")
    text = TextTokens(model)
    samples: list[dict[str, Any]] = []
    with RedisProcess() as server, Progress(console=console) as progress:
        task = progress.add_task(
            "loading the standby", total=repeats * len(contexts) * len(CASES) + 1
        )
        admin = redis.Redis.from_url(server.url)
        store = RedisStore.from_url(server.url)
        standby = WorkerProcess(model, *worker_flags(server.url, "worker-b"))
        try:
            standby.start()
            # Warm-up: the standby's first resume and first long prefill pay one-off costs.
            one_sample(model, server, admin, store, standby, fingerprint, text, 512, "aligned", -1)
            progress.update(task, advance=1)
            sample = 0
            for _ in range(repeats):
                for context in contexts:
                    for case in CASES:
                        progress.update(task, description=f"{context} tokens, {case}")
                        samples.append(
                            one_sample(
                                model,
                                server,
                                admin,
                                store,
                                standby,
                                fingerprint,
                                text,
                                context,
                                case,
                                sample,
                            )
                        )
                        sample += 1
                        progress.update(task, advance=1)
        finally:
            standby.stop()
            store.close()
            admin.close()
    return summarize(samples, model, repeats)


def summarize(samples: list[dict[str, Any]], model: str, repeats: int) -> dict[str, Any]:
    table: list[dict[str, Any]] = []
    for context in sorted({s["context"] for s in samples}):
        for case in CASES:
            mine = [s for s in samples if s["context"] == context and s["case"] == case]
            if not mine:
                continue
            resume_ms = statistics.median(s["resume"]["ms"] for s in mine)
            recompute_ms = statistics.median(s["recompute"]["ms"] for s in mine)
            table.append(
                {
                    "context": context,
                    "case": case,
                    "samples": len(mine),
                    "context_tokens": [s["context_tokens"] for s in mine],
                    "loaded_tokens": [s["resume"]["loaded_tokens"] for s in mine],
                    "recomputed_tokens": [s["resume"]["recomputed_tokens"] for s in mine],
                    "resume_ms_median": resume_ms,
                    "recompute_ms_median": recompute_ms,
                    "speedup": recompute_ms / resume_ms,
                    "speedup_per_sample": [s["recompute"]["ms"] / s["resume"]["ms"] for s in mine],
                }
            )
    return {
        "model": model,
        "dtype": "bfloat16",
        "block_tokens": BLOCK_TOKENS,
        "max_model_len": MAX_MODEL_LEN,
        "generated_tokens_before_loss": GENERATED_TOKENS,
        "repeats": repeats,
        "summary": table,
        "samples": samples,
    }


def print_report(result: dict[str, Any], console: Console) -> None:
    table = Table(
        title=f"Resume vs full recompute on a standby, {Path(result['model']).name} "
        f"({result['dtype']}, median of {result['repeats']})"
    )
    for column in (
        "context",
        "case",
        "context tokens (samples)",
        "loaded / recomputed (median)",
        "resume → first new token",
        "re-prefill → first token",
        "speedup",
    ):
        table.add_column(column)
    for row in result["summary"]:
        table.add_row(
            str(row["context"]),
            row["case"],
            ", ".join(str(t) for t in row["context_tokens"]),
            f"{statistics.median(row['loaded_tokens']):.0f} / "
            f"{statistics.median(row['recomputed_tokens']):.0f}",
            f"{row['resume_ms_median']:.1f} ms",
            f"{row['recompute_ms_median']:.1f} ms",
            f"{row['speedup']:.1f}x",
        )
    console.print(table)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.2))
    rows = result["summary"]
    for case, marker in (("aligned", "o"), ("abrupt", "s")):
        mine = [r for r in rows if r["case"] == case]
        contexts = [r["context"] for r in mine]
        axis.plot(
            contexts,
            [r["resume_ms_median"] for r in mine],
            marker=marker,
            label=f"resume ({case}: recomputes {'0' if case == 'aligned' else '127'} tokens)",
        )
    recompute: dict[int, list[float]] = {}
    for row in rows:
        recompute.setdefault(row["context"], []).append(row["recompute_ms_median"])
    contexts = sorted(recompute)
    axis.plot(
        contexts,
        [statistics.median(recompute[c]) for c in contexts],
        marker="^",
        color="black",
        label="full re-prefill",
    )
    axis.set_yscale("log")
    axis.set_xticks(contexts)
    axis.set_xlabel("context tokens (prompt + generated)")
    axis.set_ylabel("time to first new token, ms (median)")
    axis.set_title(
        "Standby: resume from Redis vs re-prefill (SmolLM2-135M, bf16, 2-core CPU)", fontsize=10
    )
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--contexts", default="512,2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="write the full result here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG here")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    if any(c % BLOCK_TOKENS or c + 1 + EXTRA_TOKENS > MAX_MODEL_LEN for c in contexts):
        parser.error(f"contexts must be multiples of {BLOCK_TOKENS} that fit {MAX_MODEL_LEN}")
    from spotinfer.models.smollm2 import resolve_model

    console = Console()
    model = str(resolve_model(args.model))
    result = measure(model, contexts, args.repeats, console)
    print_report(result, console)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
