"""Stall: what a resume's KV load from Redis costs the other sequences on the same worker,
asynchronous load vs the synchronous baseline.

    python -m benchmarks.kv_load_stall [--context 4097] [--streams 8] [--rounds 3]
        [--dtype bfloat16] [--redis-nice 0] [--modes sync async]
        [--json docs/bench/kv_load_stall.json]

Real processes only: a redis-server started here, two standby workers that stay loaded —
one with ``--kv-load async`` (the default), one with ``--kv-load sync`` (the store read
inside the scheduler call, the copy before the next forward pass) — and for every sample a
fresh source worker A (SmolLM2-135M-Instruct, bfloat16, eager persistence, 256-token
chunks, max_model_len 4608).

One sample: A generates from a prompt of real token ids until the context is --context
tokens and every full chunk of its KV is in Redis, and is SIGKILLed. At 4,097 tokens the KV
of 4,096 — 16 whole chunks — is stored, so the resume loads it all and computes only the
last token: the window measures the load, not a recompute. On the standby under
test, --streams other requests decode (short prompts, long outputs); once every one of
them streams, the benchmark calls `Worker.Resume` for A's request (t0) and waits for its
first new token (t1). The other streams' decode rate is counted from their chunks' arrival
times: during the load, [t0, t1], and without it, the --baseline-seconds before t0.

    stall ratio = rate during the load ÷ rate without it        (1.0: no stall)

The load's own work (Redis sending the blocks, the fetcher reading and checking them, the
copy into the cache) is nearly fixed for a context; the others' step is not: it depends on the
CPU's vector extensions and the dtype (bfloat16 without AVX-512 is several times slower).
The result records the CPU and each sample the baseline's step, so that ratios from
different machines are read side by side with them.

The window [t0, t1] ends with the step that gives the resumed request its first token; that
step gave the other streams theirs as well, and their chunks reach the benchmark within a few
ms of t1, before or after: they are counted up to t1 + a quarter of the baseline's step
interval (too short to reach the next step).

Beside it, the step ratio of the load alone: the others' mean step in the baseline ÷ their
mean step from t0 to the step in which the resumed request joins their batch. That step
carries a 4k-token context, a cost of serving the request (every later step pays it too),
not of loading it; the stall ratio counts it, this one does not. The stall ratio is the
figure the target is set on.

The redis-server runs on the worker's own cores here; in a deployment it is another machine
(ElastiCache, Memorystore: infra/terraform), and sending a 4k context costs it 140–250 ms of
CPU that a worker never pays. ``--redis-nice 19`` gives it the lowest CPU priority, as the
fetcher has: the worker's processes then get the cores first, as they would beside a remote
Redis. The default (0) is the harsher setting; the result records which was used.

The two modes alternate in order from round to round, each on a fresh source request;
medians over rounds. The resume's MIGRATED / RECOVERED event must say the context was
loaded (recomputed ≤ one chunk), or the sample is refused.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from typing import Any

import grpc
from rich.console import Console
from rich.progress import Progress

from benchmarks.harness import (
    benchmark_parser,
    cpu_description,
    engine_flags,
    print_table,
    resolve_model_arg,
    rotated,
    write_json,
)
from benchmarks.resume_latency import TextTokens, greedy, persist_then_kill, time_resume, wait_idle
from spotinfer.local.redis_process import RedisProcess
from spotinfer.local.worker_process import WorkerProcess
from store import RedisStore

MODES = ("sync", "async")
MAX_MODEL_LEN = 4608
KV_CACHE_BYTES = 1 << 30
CHUNK_TOKENS = 256
GENERATED_TOKENS = 32  # of the context, A generates these; the rest is prompt
STREAM_PROMPT_TOKENS = 64
STREAM_TIMEOUT_SECONDS = 600.0
START_TIMEOUT_SECONDS = 120.0
STEP_SLACK = 0.25  # of a step: how late after t1 the others' chunks of t1's step may arrive


class TimedStream:
    """One of the other requests: its output chunks' arrival times and sizes."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.arrivals: list[tuple[float, int]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self._stream:
                if response.token_ids:
                    self.arrivals.append((time.perf_counter(), len(response.token_ids)))
        except grpc.RpcError:
            pass  # cancelled at the end of the sample

    @property
    def finished(self) -> bool:
        """Its stream ended (it decoded all its tokens, or broke)."""
        return not self._thread.is_alive()

    def tokens_between(self, start: float, end: float) -> int:
        return sum(n for at, n in self.arrivals if start <= at < end)

    def stop(self) -> None:
        self._stream.cancel()
        self._thread.join(10)


def step_gaps(streams: list[TimedStream], start: float, end: float) -> list[float]:
    """The times between two chunks of one stream, both in [start, end): decode steps."""
    return [
        later - earlier
        for stream in streams
        for (earlier, _), (later, _) in zip(stream.arrivals, stream.arrivals[1:], strict=False)
        if start <= earlier and later < end
    ]


def _median(gaps: list[float]) -> float:
    return float(statistics.median(gaps)) if gaps else 0.0


def _mean(gaps: list[float]) -> float:
    return float(statistics.fmean(gaps)) if gaps else 0.0


def worker_flags(
    redis_url: str, worker_id: str, kv_load: str = "async", dtype: str = "bfloat16"
) -> tuple[str, ...]:
    return (
        *engine_flags(dtype, MAX_MODEL_LEN, KV_CACHE_BYTES),
        *("--redis-url", redis_url),
        *("--kv-persist-policy", "eager"),
        *("--kv-chunk-tokens", str(CHUNK_TOKENS)),
        *("--kv-load", kv_load),
        *("--worker-id", worker_id),
    )


def one_sample(
    args: Any,
    model: str,
    server: RedisProcess,
    store: RedisStore,
    standby: WorkerProcess,
    fingerprint: str,
    text: TextTokens,
    sample: int,
) -> dict[str, Any]:
    request_id = f"stall-{sample}"
    prompt = text.prompt(args.context - GENERATED_TOKENS, seed=1000 + sample)
    with WorkerProcess(
        model, *worker_flags(server.url, f"source-{sample}", dtype=args.dtype)
    ) as source:
        committed = persist_then_kill(
            source, store, fingerprint, request_id, prompt, GENERATED_TOKENS, CHUNK_TOKENS
        )
    streams = [
        TimedStream(
            standby.stub.Generate(
                greedy(
                    f"{request_id}-other-{i}",
                    text.prompt(STREAM_PROMPT_TOKENS, seed=5000 + 100 * sample + i),
                    args.stream_tokens,
                ),
                timeout=STREAM_TIMEOUT_SECONDS,
            )
        )
        for i in range(args.streams)
    ]
    try:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not all(s.arrivals for s in streams):
            if time.monotonic() > deadline:
                raise TimeoutError("the other streams did not start")
            time.sleep(0.01)
        time.sleep(args.baseline_seconds + 0.5)  # every stream decoding through the baseline
        t0 = time.perf_counter()
        resumed = time_resume(standby, request_id, len(committed))
        t1 = float(resumed["first_token_at"])
        ended = [i for i, s in enumerate(streams) if s.finished]
        if ended:
            raise RuntimeError(f"streams {ended} ended inside the load: raise --stream-tokens")
        before = sum(s.tokens_between(t0 - args.baseline_seconds, t0) for s in streams)
        # The step that gives the resumed request its first token gives the others theirs
        # too; their chunks reach this process a few ms before or after t1 (other threads,
        # other streams). A quarter of a step's interval counts that step's own tokens and
        # cannot reach the next step's.
        baseline = step_gaps(streams, t0 - args.baseline_seconds, t0)
        step = _median(baseline)
        slack = STEP_SLACK * step
        during = sum(s.tokens_between(t0, t1 + slack) for s in streams)
        # The load alone: the others' steps from t0 up to the step in which the resumed
        # request joins their batch (its first step carries a 4k-token context: the cost of
        # serving it, not of loading it). Reported beside the ratio, not instead of it.
        step_before = _mean(baseline)
        step_loading = _mean(step_gaps(streams, t0, t1 - slack))
        steps_ms = [  # one stream's chunk gaps, by arrival (ms after t0): where time went
            (round((later - t0) * 1000), round((later - earlier) * 1000, 1))
            for (earlier, _), (later, _) in zip(
                streams[0].arrivals, streams[0].arrivals[1:], strict=False
            )
            if t0 - 0.5 <= earlier and later <= t1 + slack
        ]
    finally:
        for stream in streams:
            stream.stop()
    wait_idle(standby)
    if resumed["recomputed_tokens"] >= CHUNK_TOKENS:
        raise RuntimeError(f"{request_id}: the resume recomputed: {resumed['detail']}")
    rate_before = before / args.baseline_seconds
    rate_during = during / (t1 - t0)
    return {
        "resume_ms": resumed["ms"],
        "loaded_tokens": resumed["loaded_tokens"],
        "recomputed_tokens": resumed["recomputed_tokens"],
        "rate_before_tokens_per_s": rate_before,
        "rate_during_tokens_per_s": rate_during,
        "stall_ratio": rate_during / rate_before,
        "step_ms_before": round(step * 1000, 1),
        "mean_step_ms_before": round(step_before * 1000, 1),
        "mean_step_ms_loading": round(step_loading * 1000, 1),
        "step_ratio_loading": step_before / step_loading if step_loading else None,
        "resume_ms_at_first_token": round((t1 - t0) * 1000),
        "one_stream_gaps_ms": steps_ms,
    }


def measure(args: Any, model: str, console: Console) -> dict[str, Any]:
    from worker.model_fingerprint import model_fingerprint

    fingerprint = model_fingerprint(model, args.dtype)
    text = TextTokens(model)
    modes: tuple[str, ...] = tuple(args.modes)
    samples: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    with RedisProcess() as server, Progress(console=console) as progress:
        if args.redis_nice:
            assert server.pid is not None
            os.setpriority(os.PRIO_PGRP, server.pid, args.redis_nice)  # its own group
        task = progress.add_task("loading the standbys", total=args.rounds * len(modes))
        store = RedisStore.from_url(server.url)
        standbys = {
            mode: WorkerProcess(
                model, *worker_flags(server.url, f"standby-{mode}", mode, args.dtype)
            )
            for mode in modes
        }
        try:
            for standby in standbys.values():
                standby.start()
            sample = 0
            for r in range(args.rounds):
                for mode in rotated(modes, r):
                    progress.update(task, description=f"round {r + 1}: {mode}")
                    samples[mode].append(
                        one_sample(
                            args, model, server, store, standbys[mode], fingerprint, text, sample
                        )
                    )
                    sample += 1
                    progress.update(task, advance=1)
        finally:
            for standby in standbys.values():
                standby.stop()
            store.close()

    def med(mode: str, key: str) -> float | None:
        values = [s[key] for s in samples[mode] if s[key] is not None]
        return float(statistics.median(values)) if values else None

    keys = (
        "stall_ratio",
        "step_ratio_loading",
        "resume_ms",
        "rate_before_tokens_per_s",
        "rate_during_tokens_per_s",
    )
    return {
        "model": model,
        "dtype": args.dtype,
        "cpu": cpu_description(),
        "context_tokens": args.context,
        "other_streams": args.streams,
        "chunk_tokens": CHUNK_TOKENS,
        "redis_nice": args.redis_nice,
        "modes": list(modes),
        "median": {mode: {key: med(mode, key) for key in keys} for mode in modes},
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, rounds=3, dtype="bfloat16")
    parser.add_argument("--context", type=int, default=4097, help="tokens of the resumed context")
    parser.add_argument("--streams", type=int, default=8, help="other requests decoding")
    parser.add_argument("--stream-tokens", type=int, default=600, help="their max_tokens")
    parser.add_argument("--baseline-seconds", type=float, default=2.0)
    parser.add_argument(
        "--redis-nice",
        type=int,
        default=0,
        choices=range(20),
        metavar="0-19",
        help="the redis-server's CPU niceness (19: out of the worker's way, as a remote one)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        help="the --kv-load modes to measure, one standby each (default: both)",
    )
    args = parser.parse_args(argv)
    model = resolve_model_arg(args.model)
    console = Console()
    result = measure(args, model, console)
    write_json(args.json, result)
    rows = [
        [
            mode,
            f"{result['median'][mode]['stall_ratio']:.2f}",
            _two_places(result["median"][mode]["step_ratio_loading"]),
            f"{result['median'][mode]['rate_before_tokens_per_s']:.1f}",
            f"{result['median'][mode]['rate_during_tokens_per_s']:.1f}",
            f"{result['median'][mode]['resume_ms']:.0f}",
        ]
        for mode in result["modes"]
    ]
    columns = [
        "kv load",
        "stall ratio",
        "step ratio, load only",
        "tokens/s before",
        "tokens/s during",
        "resume ms",
    ]
    print_table(console, "Other streams' decode during a 4k resume (medians)", columns, rows)
    return 0


def _two_places(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
