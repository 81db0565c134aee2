"""Migration downtime: the longest pause between consecutive tokens a client sees when its
request moves on a termination notice, at several context lengths.

    python -m benchmarks.migration_downtime [--contexts 256,1024,2048,4096]
        [--repeats 3] [--json docs/bench/migration_downtime.json]
        [--plot docs/bench/migration_downtime.png] [--tls]

With ``--tls`` every hop is encrypted as the local cluster runs it: the client reaches the
coordinator over TLS with an API key, coordinator, workers and daemons talk mutual TLS
(certificates made in the log folder).

Real processes only: a redis-server on a free port; per sample a worker A (SmolLM2-135M,
bfloat16, eager KV persistence) with its context daemon, the standby worker B (kept loaded
across samples) with its daemon, and a coordinator (`--failover-policy resume`) that knows
both daemons. A client streams one greedy request through the coordinator's gRPC front with a
prompt of C - 32 real tokens; once it has received 32 tokens (the context is C), the drill
calls `Control.InjectNotice` for A: the coordinator stages the request on B (B prefetches its
persisted blocks while A still decodes), then asks A's daemon to flush, A pauses the request
and persists its tail, and the coordinator resumes it on B from the client's next index.

Measured on the client (per token arrival times, `time.time()`):

- ``gap_ms``: the switch — the longest gap between consecutive tokens from the last token A
  streamed to the first token B generated (after the MIGRATED event). Tokens A generated
  but never streamed (the pause drops the step in flight) come from the store in between,
  as B takes the request: ``to_stored_ms`` is the gap before them, ``to_new_ms`` the one
  after them (the whole switch when there are none);
- ``step_ms``: the median inter-token time of the tokens before the notice (one decode step);
- ``gap_steps`` = gap / step;

and, from the logs of the coordinator (the line it writes when the flush report has arrived
and it calls Worker.Resume), where the gap goes: ``pause_ms`` (last A token -> the NOTICE
event that ends A's stream), ``flush_wait_ms`` (NOTICE event -> flush report at the
coordinator), ``resume_ms`` (Resume call -> first new token from B: record read, block
loads, one step); and ``staging_ms`` (the stages before the pause, while A decodes: not downtime) with
``staged_blocks``. Medians over repeats; targets: 4k / 256 <= 1.5 and gap <= 3 decode steps.
"""

from __future__ import annotations

import datetime
import json
import re
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
from rich.progress import Progress

from benchmarks.harness import (
    benchmark_parser,
    engine_flags,
    plot_figure,
    resolve_model_arg,
    write_json,
)
from benchmarks.resume_latency import TextTokens
from common.channels import sync_channel
from protos.spotinfer.v1 import common_pb2, control_pb2, inference_pb2_grpc
from spotinfer.local.cluster_secrets import ClusterSecrets
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.daemon_process import DaemonProcess
from spotinfer.local.metadata_servers import AwsImds
from spotinfer.local.redis_process import RedisProcess
from spotinfer.local.worker_process import WorkerProcess

MAX_MODEL_LEN = 4608
KV_CACHE_BYTES = 1 << 30
TOKENS_BEFORE_NOTICE = 32
TOKENS_AFTER_NOTICE = 32
NOTICE_GRACE_SECONDS = 30.0
STREAM_TIMEOUT_SECONDS = 600.0
READY_TIMEOUT_SECONDS = 120.0
_STAGED = re.compile(r"(\d+) blocks prefetched before the pause")
_STAGING_TIME = re.compile(r"staged on their targets in (\d+) ms")
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def worker_flags(redis_url: str, worker_id: str, socket_path: Path) -> tuple[str, ...]:
    return (
        *engine_flags("bfloat16", MAX_MODEL_LEN, KV_CACHE_BYTES),
        *("--redis-url", redis_url),
        *("--kv-persist-policy", "eager"),
        *("--worker-id", worker_id),
        *("--unix-socket", str(socket_path)),
    )


def start_node(
    stack: ExitStack,
    model: str,
    redis_url: str,
    worker_id: str,
    log_dir: Path,
    secrets: ClusterSecrets,
) -> tuple[WorkerProcess, DaemonProcess]:
    """A worker and its daemon (reaching it over a unix socket), metadata server idle."""
    log_dir.mkdir(parents=True, exist_ok=True)
    socket_path = log_dir / f"{worker_id}.sock"
    metadata = stack.enter_context(AwsImds())
    worker = stack.enter_context(
        WorkerProcess(
            model,
            *worker_flags(redis_url, worker_id, socket_path),
            *secrets.flags("worker"),
            log_dir=log_dir,
            transport=secrets.operator_transport,
        )
    )
    daemon = stack.enter_context(
        DaemonProcess(
            *("--notice-source", "aws"),
            *("--metadata-url", metadata.base_url),
            *("--worker-address", f"unix:{socket_path}"),
            *("--redis-url", redis_url),
            *("--daemon-id", f"daemon-of-{worker_id}"),
            *secrets.flags("daemon"),
            log_dir=log_dir,
            transport=secrets.operator_transport,
        )
    )
    return worker, daemon


class ClientStream:
    """One Generate stream read on a thread: arrival time of every token and event."""

    def __init__(self, call: Any) -> None:
        self.token_times: list[float] = []
        self.token_workers: list[str] = []
        self.events: list[tuple[float, int, Any]] = []  # (time, token count then, event)
        self.finish_reason = 0
        self.error: grpc.RpcError | None = None
        self._call = call
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                now = time.time()
                if response.HasField("event"):
                    self.events.append((now, len(self.token_times), response.event))
                fresh = response.index + len(response.token_ids) - len(self.token_times)
                for _ in range(max(0, fresh)):
                    self.token_times.append(now)
                    self.token_workers.append(response.worker_id)
                if response.finish_reason:
                    self.finish_reason = response.finish_reason
        except grpc.RpcError as error:
            self.error = error

    def join(self) -> None:
        self._thread.join(STREAM_TIMEOUT_SECONDS)

    def event(self, kind: int) -> tuple[float, int, Any]:
        found = [e for e in self.events if e[2].kind == kind]
        if len(found) != 1:
            raise RuntimeError(f"expected one event of kind {kind}, got {self.events}")
        return found[0]


def _log_time(line: str) -> float:
    match = _LOG_TIME.match(line)
    assert match is not None, line
    moment = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
    return moment.timestamp()


def _migrating_at(coordinator: CoordinatorProcess, request_id: str) -> float:
    """When the coordinator had the flush report and called Worker.Resume (its log line)."""
    for line in coordinator.output.splitlines():
        if f"request {request_id}: migrating from" in line:
            return _log_time(line)
    raise RuntimeError(f"no migration of {request_id} in the coordinator's log")


def one_sample(
    model: str,
    redis_url: str,
    standby: tuple[WorkerProcess, DaemonProcess],
    prompt: list[int],
    request_id: str,
    log_dir: Path,
    secrets: ClusterSecrets,
) -> dict[str, Any]:
    with ExitStack() as stack:
        source, source_daemon = start_node(stack, model, redis_url, "worker-a", log_dir, secrets)
        target, target_daemon = standby
        coordinator = stack.enter_context(
            CoordinatorProcess(
                *("--worker", f"{source.address}={source_daemon.address}"),
                *("--standby", f"{target.address}={target_daemon.address}"),
                *("--failover-policy", "resume"),
                *("--redis-url", redis_url),
                *("--heartbeat-interval-seconds", "0.5"),
                *secrets.flags("coordinator"),
                log_dir=log_dir,
                transport=secrets.operator_transport,
            )
        )
        _wait_watched(coordinator)
        client = stack.enter_context(
            sync_channel(
                coordinator.address, transport=secrets.client_transport, api_key=secrets.api_key
            )
        )
        stream = ClientStream(
            inference_pb2_grpc.InferenceStub(client).Generate(
                common_pb2.GenerateRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    sampling=common_pb2.SamplingParams(
                        max_tokens=TOKENS_BEFORE_NOTICE + TOKENS_AFTER_NOTICE,
                        temperature=0.0,
                        ignore_eos=True,
                    ),
                ),
                timeout=STREAM_TIMEOUT_SECONDS,
            )
        )
        while len(stream.token_times) < TOKENS_BEFORE_NOTICE:
            if stream.finish_reason or stream.error:
                raise RuntimeError(f"the stream ended early: {stream.error}")
            time.sleep(0.001)
        coordinator.control.InjectNotice(
            control_pb2.InjectNoticeRequest(
                worker_id="worker-a",
                kind=control_pb2.NOTICE_KIND_TERMINATE,
                grace_seconds=NOTICE_GRACE_SECONDS,
            ),
            timeout=10,
        )
        stream.join()
        if stream.error is not None or stream.finish_reason != common_pb2.FINISH_REASON_LENGTH:
            raise RuntimeError(f"the stream did not complete: {stream.error}")
        return _measure(stream, coordinator, request_id, len(prompt))


def _measure(
    stream: ClientStream, coordinator: CoordinatorProcess, request_id: str, prompt_tokens: int
) -> dict[str, Any]:
    notice_at, tokens_from_a, _ = stream.event(common_pb2.EVENT_KIND_NOTICE)
    migrated_at, tokens_before_new, migrated = stream.event(common_pb2.EVENT_KIND_MIGRATED)
    times = stream.token_times
    last_a = times[tokens_from_a - 1]
    first_b = times[tokens_before_new]
    switch = times[tokens_from_a - 1 : tokens_before_new + 1]
    gap = max(b - a for a, b in zip(switch, switch[1:], strict=False))
    stored_at = times[tokens_from_a] if tokens_before_new > tokens_from_a else first_b
    before = [
        b - a for a, b in zip(times[: tokens_from_a - 1], times[1:tokens_from_a], strict=True)
    ]
    # Steady decode only: the first few steps after the prefill can be uneven.
    step = statistics.median(before[4:] or before)
    resume_called = _migrating_at(coordinator, request_id)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {
        "context_tokens": prompt_tokens + tokens_from_a,
        "tokens_from_source": tokens_from_a,
        "tokens_from_store": tokens_before_new - tokens_from_a,
        "gap_ms": gap * 1000,
        "to_stored_ms": (stored_at - last_a) * 1000,
        "to_new_ms": (first_b - stored_at) * 1000,
        "step_ms": step * 1000,
        "gap_steps": gap / step,
        "max_gap_ms": max(gaps) * 1000,
        # Where the stream's longest gap fell, in tokens after the last one from A (<= 0:
        # before the switch, while the standby staged and warmed the blocks).
        "max_gap_after_switch": gaps.index(max(gaps)) + 1 - (tokens_from_a - 1),
        "pause_ms": (notice_at - last_a) * 1000,
        "flush_wait_ms": (resume_called - notice_at) * 1000,
        "resume_ms": (first_b - resume_called) * 1000,
        "migrated_event_to_first_token_ms": (first_b - migrated_at) * 1000,
        "loaded_tokens": migrated.loaded_tokens,
        "recomputed_tokens": migrated.recomputed_tokens,
        "staged_blocks": _staged_blocks(migrated.detail),
        "staging_ms": _staging_ms(coordinator),
    }


def _staged_blocks(detail: str) -> int:
    """Blocks the standby prefetched before the pause (the MIGRATED event says)."""
    match = _STAGED.search(detail)
    return int(match.group(1)) if match else 0


def _staging_ms(coordinator: CoordinatorProcess) -> float:
    """How long the stages before the pause took (the coordinator's log line); the source
    decodes all the while, so this is not downtime."""
    match = _STAGING_TIME.search(coordinator.output)
    return float(match.group(1)) if match else 0.0


def _wait_watched(coordinator: CoordinatorProcess) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        infos = coordinator.control.ListWorkers(control_pb2.ListWorkersRequest(), timeout=10)
        if len(infos.workers) == 2 and all(
            w.notices_watched and w.state == control_pb2.WORKER_STATE_READY for w in infos.workers
        ):
            return
        time.sleep(0.1)
    raise TimeoutError(f"workers not ready and watched:\n{coordinator.output[-3000:]}")


def summarize(samples: list[dict[str, Any]], contexts: list[int]) -> list[dict[str, Any]]:
    rows = []
    for context in contexts:
        mine = [s for s in samples if s["context"] == context]
        row: dict[str, Any] = {"context": context, "samples": len(mine)}
        for name in (
            "gap_ms",
            "step_ms",
            "gap_steps",
            "to_stored_ms",
            "to_new_ms",
            "tokens_from_store",
            "pause_ms",
            "flush_wait_ms",
            "resume_ms",
            "staging_ms",
            "staged_blocks",
        ):
            row[f"{name}_median"] = statistics.median(s[name] for s in mine)
        row["recomputed_tokens"] = [s["recomputed_tokens"] for s in mine]
        rows.append(row)
    return rows


def plot(result: dict[str, Any], path: Path) -> None:
    rows = result["summary"]
    contexts = [r["context"] for r in rows]
    with plot_figure(path) as (_, (axis,)):
        axis.plot(contexts, [r["gap_ms_median"] for r in rows], marker="o", label="switch gap")
        for name, label in (
            ("pause_ms_median", "pause (last token from A -> NOTICE)"),
            ("flush_wait_ms_median", "flush wait (NOTICE -> flush report)"),
            ("resume_ms_median", "resume on B (Resume -> first new token)"),
        ):
            axis.plot(contexts, [r[name] for r in rows], marker=".", linestyle="--", label=label)
        axis.plot(
            contexts,
            [3 * r["step_ms_median"] for r in rows],
            color="black",
            linestyle=":",
            label="target: 3 decode steps",
        )
        axis.set_xscale("log", base=2)
        axis.set_xticks(contexts)
        axis.set_xticklabels([str(c) for c in contexts])
        axis.set_xlabel("context tokens at the notice")
        axis.set_ylabel("ms (median)")
        axis.set_title(
            "Migration downtime on a notice, as the client sees it (SmolLM2-135M, bf16, CPU)",
            fontsize=10,
        )
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, rounds=3, rounds_flag="--repeats", plot=True)
    parser.add_argument("--contexts", default="256,1024,2048,4096")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/migration-downtime"))
    parser.add_argument("--tls", action="store_true", help="TLS, mutual TLS and an API key")
    args = parser.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    secrets = ClusterSecrets.make(args.log_dir) if args.tls else ClusterSecrets()
    model = resolve_model_arg(args.model)
    contexts = [int(c) for c in args.contexts.split(",")]
    texts = TextTokens(model)
    samples: list[dict[str, Any]] = []
    with ExitStack() as stack:
        redis = stack.enter_context(RedisProcess())
        standby = start_node(stack, model, redis.url, "worker-b", args.log_dir / "standby", secrets)
        progress = stack.enter_context(Progress(transient=False))
        task = progress.add_task("migrations", total=args.repeats * len(contexts))
        for repeat in range(args.repeats):  # interleaved: the box is shared
            for context in contexts:
                progress.update(task, description=f"migration at {context} tokens")
                prompt = texts.prompt(context - TOKENS_BEFORE_NOTICE, seed=1000 * repeat + context)
                request_id = f"downtime-{context}-{repeat}"
                sample = one_sample(
                    model,
                    redis.url,
                    standby,
                    prompt,
                    request_id,
                    args.log_dir / request_id,
                    secrets,
                )
                sample.update(context=context, repeat=repeat)
                samples.append(sample)
                progress.console.print(json.dumps(sample))
                progress.advance(task)
    rows = summarize(samples, contexts)
    by_context = {r["context"]: r for r in rows}
    result: dict[str, Any] = {
        "model": model,
        "dtype": "bfloat16",
        "command": "python -m benchmarks.migration_downtime " + " ".join(sys.argv[1:]),
        "repeats": args.repeats,
        "tls": args.tls,
        "summary": rows,
        "samples": samples,
    }
    if contexts[0] in by_context and contexts[-1] in by_context:
        result["ratio_longest_to_shortest"] = (
            by_context[contexts[-1]]["gap_ms_median"] / by_context[contexts[0]]["gap_ms_median"]
        )
    for row in rows:
        print(
            f"context {row['context']:>5}: gap {row['gap_ms_median']:7.1f} ms = "
            f"{row['gap_steps_median']:5.1f} steps of {row['step_ms_median']:.1f} ms "
            f"(to the stored tokens {row['to_stored_ms_median']:.1f}, then to the first new "
            f"{row['to_new_ms_median']:.1f}; pause {row['pause_ms_median']:.1f}, flush wait "
            f"{row['flush_wait_ms_median']:.1f}, resume {row['resume_ms_median']:.1f}); "
            f"recomputed {row['recomputed_tokens']}"
        )
    if "ratio_longest_to_shortest" in result:
        print(f"ratio {contexts[-1]}/{contexts[0]}: {result['ratio_longest_to_shortest']:.2f}")
    write_json(args.json, result, indent=1)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
