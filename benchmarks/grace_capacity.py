"""Grace-window capacity: how much KV the lazy policy flushes before a 30 s notice deadline.

    python -m benchmarks.grace_capacity [--requests 16] [--prompt-tokens 2048]
                                             [--grace-seconds 30] [--json OUT]

Real processes only: a redis-server started here on a free port and one worker
(SmolLM2-135M-Instruct, bfloat16, ``--kv-persist-policy lazy``: no KV is written before the
notice, so the flush has to write all of it), with enough KV cache for every request.

N requests with distinct long prompts of real token ids run concurrently until each has
streamed a few tokens; then, at T0, the benchmark calls the worker's
`Worker.Preempt(deadline = T0 + grace)` as the daemon does on a notice. The worker pauses
every request and its connector writes each one's tokens, full blocks and partial tail
(in the flush planner's order); Preempt reports each request when the store holds it
complete. Reported: requests complete before the deadline, tokens of KV they hold (context
minus the last token, which a standby computes anyway) and MB (the stored block values,
read back from Redis), and the flush rate = those bytes / (last completion - T0).

This machine cannot hold 30 s worth of flush (at the measured rate that is tens of GB of KV
in the worker and again in Redis, on a 24 GiB box), so the load is sized to take a few
seconds and the 30 s capacity is EXTRAPOLATED from the measured rate: tokens of SmolLM2 KV
(23,040 bytes/token) and of Llama-3-8B KV (128 KiB/token, bf16) that the same byte rate
moves in the grace window. The rate is that of one connection from one writer thread to a
Redis on loopback, on a shared 2-core machine.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import redis
from rich.console import Console

from benchmarks.harness import benchmark_parser, engine_flags, resolve_model_arg, write_json
from benchmarks.kv_persistence import BLOCK_TOKENS, Geometry
from benchmarks.resume_latency import StreamReader, TextTokens, greedy
from spotinfer.local.redis_process import RedisProcess
from spotinfer.local.worker_process import WorkerProcess
from store import RedisStore

LLAMA3_8B_KV_BYTES_PER_TOKEN = 128 * 1024  # 2 x 32 layers x 8 kv heads x 128 x 2 bytes
MB = 1_000_000
MAX_MODEL_LEN = 4608
TOKENS_BEFORE_NOTICE = 4  # every request has left prefill and is decoding
OUTPUT_TOKENS = 2048  # far more than it decodes before the notice: all still run at T0
START_TIMEOUT_SECONDS = 1200.0
POLL_SECONDS = 0.05


def worker_flags(redis_url: str, kv_cache_bytes: int, max_num_seqs: int) -> tuple[str, ...]:
    return (
        *engine_flags("bfloat16", MAX_MODEL_LEN, kv_cache_bytes, max_num_seqs),
        *("--redis-url", redis_url),
        *("--kv-persist-policy", "lazy"),
        *("--worker-id", "grace-a"),
    )


def stored_kv_bytes(admin: redis.Redis) -> tuple[int, int]:
    """Bytes and count of every stored KV block value (full blocks and tails), by SCAN."""
    total = count = 0
    for pattern in ("si:v1:blk:*", "si:v1:req:*:tail"):
        for key in admin.scan_iter(match=pattern, count=1000):
            total += int(admin.strlen(key))
            count += 1
    return total, count


def measure(model: str, requests: int, prompt_tokens: int, grace_seconds: float) -> dict[str, Any]:
    from protos.spotinfer.v1 import worker_pb2

    geometry = Geometry.of_model(Path(model))
    bytes_per_token = geometry.payload_bytes // BLOCK_TOKENS
    tokens_per_request = prompt_tokens + OUTPUT_TOKENS
    # Room for every request at full length, plus a quarter for vLLM's own slack.
    kv_cache_bytes = int(requests * tokens_per_request * bytes_per_token * 1.25)
    text = TextTokens(model)
    with RedisProcess() as server:
        admin = redis.Redis.from_url(server.url)
        store = RedisStore.from_url(server.url)
        flags = worker_flags(server.url, kv_cache_bytes, requests)
        with WorkerProcess(model, *flags) as worker:
            readers = [
                StreamReader(
                    worker.stub.Generate(
                        greedy(f"grace-{i}", text.prompt(prompt_tokens, seed=i), OUTPUT_TOKENS),
                        timeout=START_TIMEOUT_SECONDS,
                    )
                )
                for i in range(requests)
            ]
            deadline = time.monotonic() + START_TIMEOUT_SECONDS
            while min(len(r.tokens) for r in readers) < TOKENS_BEFORE_NOTICE:
                if time.monotonic() > deadline:
                    raise TimeoutError("the requests never all reached decoding")
                time.sleep(POLL_SECONDS)
            before_bytes, _ = stored_kv_bytes(admin)
            t0 = time.perf_counter()
            deadline_unix = time.time() + grace_seconds
            progress = []
            for state in worker.stub.Preempt(
                worker_pb2.PreemptRequest(deadline_unix=deadline_unix),
                timeout=grace_seconds + 60,
            ):
                progress.append(
                    {
                        "request_id": state.request_id,
                        "complete": state.complete,
                        "context_tokens": state.context_tokens,
                        "persisted_blocks": state.persisted_blocks,
                        "tail_persisted": state.tail_persisted,
                        "seconds_after_notice": time.perf_counter() - t0,
                    }
                )
            for reader in readers:
                reader.join()
        kv_bytes, kv_values = stored_kv_bytes(admin)
        store.close()
        admin.close()
    complete = [p for p in progress if p["complete"]]
    flush_seconds = max((p["seconds_after_notice"] for p in complete), default=float("nan"))
    kv_tokens = sum(max(0, p["context_tokens"] - 1) for p in complete)
    rate = (kv_bytes - before_bytes) / flush_seconds if complete else 0.0
    return {
        "model": model,
        "dtype": "bfloat16",
        "policy": "lazy",
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "grace_seconds": grace_seconds,
        "kv_bytes_per_token": bytes_per_token,
        "kv_cache_bytes": kv_cache_bytes,
        "kv_bytes_stored_before_notice": before_bytes,
        "requests_complete_before_deadline": len(complete),
        "requests_paused": len(progress),
        "kv_tokens_persisted": kv_tokens,
        "kv_mb_persisted": kv_bytes / MB,
        "kv_values_stored": kv_values,
        "flush_seconds": flush_seconds,
        "completion_seconds_median": statistics.median(p["seconds_after_notice"] for p in complete)
        if complete
        else None,
        "flush_mb_per_second": rate / MB,
        "extrapolated": {
            "note": "the measured rate times the grace window; the load itself took "
            "flush_seconds, not the whole window",
            "smollm2_tokens_in_grace": int(rate * grace_seconds / bytes_per_token),
            "llama3_8b_tokens_in_grace": int(rate * grace_seconds / LLAMA3_8B_KV_BYTES_PER_TOKEN),
            "gb_in_grace": rate * grace_seconds / 1e9,
        },
        "progress": progress,
    }


def print_report(result: dict[str, Any], console: Console) -> None:
    extra = result["extrapolated"]
    console.print(
        f"lazy flush of {result['requests']} requests x {result['prompt_tokens']}-token "
        f"prompts: {result['requests_complete_before_deadline']} of "
        f"{result['requests_paused']} complete before the {result['grace_seconds']:.0f} s "
        f"deadline; {result['kv_tokens_persisted']:,} tokens of KV "
        f"({result['kv_mb_persisted']:.0f} MB) in {result['flush_seconds']:.2f} s = "
        f"{result['flush_mb_per_second']:.0f} MB/s"
    )
    console.print(
        f"extrapolated to {result['grace_seconds']:.0f} s at that rate: "
        f"{extra['gb_in_grace']:.1f} GB = {extra['smollm2_tokens_in_grace']:,} tokens of "
        f"SmolLM2-135M KV, {extra['llama3_8b_tokens_in_grace']:,} tokens of Llama-3-8B KV "
        f"(128 KiB/token)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--grace-seconds", type=float, default=30.0)
    args = parser.parse_args(argv)
    if args.prompt_tokens + OUTPUT_TOKENS > MAX_MODEL_LEN:
        parser.error(f"prompt + {OUTPUT_TOKENS} output tokens must fit {MAX_MODEL_LEN}")
    console = Console()
    model = resolve_model_arg(args.model)
    result = measure(model, args.requests, args.prompt_tokens, args.grace_seconds)
    print_report(result, console)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
