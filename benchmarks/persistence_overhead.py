"""Decode tokens/s with eager KV persistence on vs off, two worker processes side by side.

    python -m benchmarks.persistence_overhead [--rounds 4] [--json OUT]
    python -m benchmarks.persistence_overhead --handoff [--rounds 4] [--json OUT]

With ``--handoff`` both workers persist eagerly and the comparison is who writes: ``off`` is
the worker-owned writer (each rank writes Redis itself), ``on`` hands every block to a
context daemon started beside it (``--kv-handoff-socket``: a shared-memory ring, the daemon
writes Redis). Both runs are checked for every block in Redis.

Two `python -m worker` processes stay loaded on the same model (SmolLM2-135M-Instruct,
bfloat16, 1 GiB of KV cache each): ``on`` with ``--redis-url`` (a redis-server started here on
a free port) and ``--kv-persist-policy eager`` — every full KV block goes to Redis and every
step's tokens are committed — and ``off`` without a store. Each round sends the same 16
concurrent greedy requests (256 output tokens, EOS ignored) to each, in alternating order.
Redis is emptied before every ``on`` run, and after it the script checks that every full
block of every request really is in Redis, under the content address the worker's model
fingerprint and the generated tokens give it; a run that persisted nothing proves nothing.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import redis
from rich.console import Console
from rich.progress import Progress

from benchmarks.harness import (
    alternating,
    benchmark_parser,
    engine_flags,
    print_table,
    prompt_ids,
    resolve_model_arg,
    write_json,
)
from spotinfer.local.daemon_process import DaemonProcess
from spotinfer.local.redis_process import RedisProcess
from spotinfer.local.worker_process import WorkerProcess
from store import RedisStore, block_hashes

BLOCK_TOKENS = 128  # vLLM-CPU's KV block size
KV_CACHE_BYTES = 1 << 30
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 64
MODES = ("off", "on")
DRAIN_TIMEOUT_SECONDS = 30.0
POLL_SECONDS = 0.05


def run_load(
    worker: WorkerProcess, prompts: list[list[int]], max_tokens: int, tag: str
) -> dict[str, Any]:
    """Every prompt at once, one stream each; returns tokens, wall seconds and the outputs."""
    from protos.spotinfer.v1 import common_pb2

    outputs: dict[str, list[int]] = {}
    lock = threading.Lock()
    gate = threading.Barrier(len(prompts) + 1)

    def one(i: int, ids: list[int]) -> None:
        request_id = f"{tag}-{i}"
        request = common_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling=common_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True
            ),
        )
        gate.wait()
        tokens: list[int] = []
        for response in worker.stub.Generate(request, timeout=900):
            tokens.extend(response.token_ids)
        with lock:
            outputs[request_id] = tokens

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
    for thread in threads:
        thread.start()
    gate.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    total = sum(len(t) for t in outputs.values())
    if total != len(prompts) * max_tokens:
        raise RuntimeError(f"{total} tokens came back, {len(prompts) * max_tokens} expected")
    return {"seconds": seconds, "tokens": total, "outputs": outputs}


def expected_blocks(fingerprint: str, prompt: list[int], output: list[int]) -> list[bytes]:
    """Content addresses of the full blocks whose KV the engine computed: the prompt and every
    output token but the last (the last one is sampled, never fed back)."""
    return block_hashes(fingerprint, prompt + output[:-1], BLOCK_TOKENS)


def check_persisted(
    store: RedisStore, admin: redis.Redis, fingerprint: str, prompts: list[list[int]], run: Any
) -> dict[str, int]:
    """Wait for the writer to drain, then count the blocks in Redis and check their names."""
    wanted = [
        h
        for i, prompt in enumerate(prompts)
        for h in expected_blocks(fingerprint, prompt, run["outputs"][f"{run['tag']}-{i}"])
    ]
    deadline = time.monotonic() + DRAIN_TIMEOUT_SECONDS
    while True:
        present = sum(store.blocks_present(wanted))
        if present == len(wanted) or time.monotonic() > deadline:
            break
        time.sleep(POLL_SECONDS)
    stored = sum(1 for _ in admin.scan_iter(match="si:v1:blk:*", count=1000))
    return {"expected_blocks": len(wanted), "present_blocks": present, "keys_in_redis": stored}


def measure(
    model: str,
    requests: int,
    max_tokens: int,
    rounds: int,
    dtype: str,
    console: Console,
    control: bool = False,
    on_first: bool = False,
    handoff: bool = False,
) -> dict[str, Any]:
    from worker.model_fingerprint import model_fingerprint

    prompts = prompt_ids(model, requests)
    fingerprint = model_fingerprint(model, dtype)
    flags = engine_flags(dtype, MAX_MODEL_LEN, KV_CACHE_BYTES, MAX_NUM_SEQS)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with RedisProcess() as server, Progress(console=console) as progress:
        task = progress.add_task("loading two workers", total=rounds * 2 + 1)
        admin = redis.Redis.from_url(server.url)
        store = RedisStore.from_url(server.url)
        store_flags = (
            ()
            if control
            else (
                *("--redis-url", server.url, "--kv-persist-policy", "eager"),
                *("--kv-chunk-tokens", str(BLOCK_TOKENS)),  # one value per 128-token block
            )
        )
        daemon = None
        if handoff:
            socket_path = f"{tempfile.mkdtemp(prefix='spot-bench-')}/handoff.sock"
            workers = {
                "off": WorkerProcess(model, *flags, *store_flags),
                "on": WorkerProcess(
                    model, *flags, *store_flags, "--kv-handoff-socket", socket_path
                ),
            }
            daemon = DaemonProcess(
                *("--notice-source", "file", "--notice-file", socket_path + ".notice"),
                *("--redis-url", server.url, "--kv-handoff-socket", socket_path),
                *("--worker-address", workers["on"].address),
            ).start()
        else:
            workers = {
                "off": WorkerProcess(model, *flags),
                "on": WorkerProcess(model, *flags, *store_flags),
            }
        try:
            for mode in ("on", "off") if on_first else ("off", "on"):
                workers[mode].start()
            for mode, worker in workers.items():  # warm-up: one-off costs of the first run
                run_load(worker, prompts[:2], 8, f"warm-{mode}")
            progress.update(task, advance=1, description="measuring")
            for r, mode in alternating(MODES, rounds):
                persisting = mode == "on" or handoff
                if persisting:
                    admin.flushall()
                tag = f"r{r}-{mode}"
                run = run_load(workers[mode], prompts, max_tokens, tag)
                run["tag"] = tag
                if persisting and not control:
                    run.update(check_persisted(store, admin, fingerprint, prompts, run))
                    if run["present_blocks"] != run["expected_blocks"]:
                        raise RuntimeError(
                            f"round {r}: {run['present_blocks']} of "
                            f"{run['expected_blocks']} blocks in Redis"
                        )
                runs[mode].append(run)
                progress.update(task, advance=1)
        finally:
            for worker in workers.values():
                worker.stop()
            if daemon is not None:
                daemon.stop()
            store.close()
            admin.close()
    result = summarize(runs, model, requests, max_tokens, dtype)
    result["control"] = control
    result["handoff"] = handoff
    result["started_first"] = "on" if on_first else "off"
    return result


def summarize(
    runs: dict[str, list[dict[str, Any]]], model: str, requests: int, max_tokens: int, dtype: str
) -> dict[str, Any]:
    def tps(run: dict[str, Any]) -> float:
        return float(run["tokens"]) / float(run["seconds"])

    medians = {mode: statistics.median(tps(r) for r in runs[mode]) for mode in MODES}
    per_round = [tps(on) / tps(off) for on, off in zip(runs["on"], runs["off"], strict=True)]
    slim = {
        mode: [{k: v for k, v in r.items() if k != "outputs"} for r in runs[mode]] for mode in MODES
    }
    for mode in MODES:
        for run in slim[mode]:
            run["tokens_per_second"] = run["tokens"] / run["seconds"]
    return {
        "model": model,
        "dtype": dtype,
        "requests": requests,
        "max_tokens": max_tokens,
        "rounds": len(runs["on"]),
        "tokens_per_second_median": medians,
        "on_vs_off_ratio": medians["on"] / medians["off"],
        "on_vs_off_ratio_per_round": per_round,
        "blocks_persisted_per_on_run": [r.get("present_blocks", 0) for r in runs["on"]],
        "runs": slim,
    }


def print_report(result: dict[str, Any], console: Console) -> None:
    medians = result["tokens_per_second_median"]
    on_label = "no store (control)" if result["control"] else "--redis-url, eager"
    off_label = "no store"
    if result.get("handoff"):
        off_label, on_label = "eager, worker writes", "eager, daemon writes (hand-off)"
    rows = []
    for mode, label in (("off", off_label), ("on", on_label)):
        rounds = ", ".join(f"{r['tokens_per_second']:.0f}" for r in result["runs"][mode])
        blocks = (
            ", ".join(str(b) for b in result["blocks_persisted_per_on_run"])
            if mode == "on"
            else "-"
        )
        rows.append((label, f"{medians[mode]:.1f}", rounds, blocks))
    print_table(
        console,
        f"Decode with eager KV persistence, {result['requests']} x "
        f"{result['max_tokens']} tokens ({result['dtype']}, median of {result['rounds']})",
        ("worker", "tokens/s (median)", "per round", "blocks in Redis per run"),
        rows,
    )
    console.print(
        f"on / off = {result['on_vs_off_ratio']:.3f} (per round: "
        + ", ".join(f"{x:.3f}" for x in result["on_vs_off_ratio_per_round"])
        + ")"
    )


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, rounds=4, dtype="bfloat16")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--control",
        action="store_true",
        help="A/A check: the second worker also runs without a store, to show how far two "
        "identical worker processes differ on this machine",
    )
    parser.add_argument("--on-first", action="store_true", help="start the persisting worker first")
    parser.add_argument(
        "--handoff",
        action="store_true",
        help="both persist eagerly: the worker's own writer vs the daemon's through the hand-off",
    )
    args = parser.parse_args(argv)
    console = Console()
    model = resolve_model_arg(args.model)
    result = measure(
        model,
        args.requests,
        args.max_tokens,
        args.rounds,
        args.dtype,
        console,
        control=args.control,
        on_first=args.on_first,
        handoff=args.handoff,
    )
    print_report(result, console)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
