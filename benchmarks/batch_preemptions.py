"""Batch-job throughput under rolling spot preemptions vs undisturbed, in the same run.

    python -m benchmarks.batch_preemptions [--model smollm2-135m] [--lines 192] [--rounds 1]
        [--output-tokens 96,160] [--interval 30] [--first 15] [--grace 8]
        [--json docs/bench/batch_preemptions.json]

One local cluster (a serving node and a warm standby, its own redis-server with TLS and ACL
users, API keys on the HTTP front) runs the same kind of job twice per round through the
Batch API (`/v1/files`, `/v1/batches`, JSONL in and out), in alternating order:

    undisturbed   the job alone
    rolling       the serving node gets a spot notice --first s after the job starts and
                  every --interval s after that; the VM is gone when its --grace ends, and a
                  new standby joins in the background, as a spot fleet's autoscaler would

Both jobs have the same line count and seeded output lengths (``ignore_eos``: every line
decodes its max_tokens); their prompt texts differ, so neither finds the other's prefix in
vLLM's cache. Before each job the cluster is settled (a serving node and a loaded standby).
Throughput = completion tokens in the job's output file ÷ (submit → status completed),
measured by the client. The job object's own counters say how many lines the notices
moved, how many tokens those moves recomputed and how many lines were started again.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from rich.console import Console
from rich.progress import Progress

from benchmarks.harness import (
    benchmark_parser,
    print_table,
    resolve_model_arg,
    rotated,
    write_json,
)
from spotinfer.local.cluster import ClusterConfig, LocalCluster

SIDES = ("undisturbed", "rolling")
POLL_SECONDS = 0.5
JOB_TIMEOUT_SECONDS = 1800.0
SETTLE_TIMEOUT_SECONDS = 300.0
FINISHED = ("completed", "failed", "cancelled", "expired")


class BatchFront:
    """The coordinator's HTTP front as an OpenAI batch client uses it (TLS, a tenant key)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self._url = cluster.coordinator.http_url
        self._ca_file = cluster.client_transport.ca_file
        self._session = requests.Session()
        self._session.headers["Authorization"] = f"Bearer {cluster.api_key}"

    def call(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        response = self._session.request(
            method, self._url + path, timeout=120, verify=self._ca_file, **kwargs
        )
        if response.status_code != 200:
            raise RuntimeError(f"{method} {path}: HTTP {response.status_code} {response.text}")
        return response

    def submit(self, lines: list[dict[str, Any]]) -> str:
        content = "".join(json.dumps(line) + "\n" for line in lines).encode()
        uploaded = self.call(
            "POST", "/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}
        ).json()
        body = {
            "input_file_id": uploaded["id"],
            "endpoint": "/v1/completions",
            "completion_window": "24h",
        }
        return str(self.call("POST", "/v1/batches", json=body).json()["id"])

    def job(self, batch_id: str) -> dict[str, Any]:
        return dict(self.call("GET", f"/v1/batches/{batch_id}").json())

    def output(self, file_id: str) -> list[dict[str, Any]]:
        text = self.call("GET", f"/v1/files/{file_id}/content").text
        return [json.loads(row) for row in text.splitlines()]


def job_lines(count: int, output_tokens: tuple[int, int], seed: int, tag: str) -> list[dict]:
    """``count`` greedy completion lines; output lengths from ``seed`` (the same for every
    job of a round), prompt texts named by ``tag`` (different per job)."""
    lengths = random.Random(seed)
    low, high = output_tokens
    return [
        {
            "custom_id": f"{tag}-{i:03d}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "prompt": f"Log {tag} entry {i}: the harbour master writes about the tide",
                "max_tokens": lengths.randint(low, high),
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for i in range(count)
    ]


@dataclass
class Rolling:
    """Spot notices to the serving node on a cadence while a job runs (see the module doc)."""

    cluster: LocalCluster
    first: float
    interval: float
    grace: float
    notices: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self, started: float) -> None:
        thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        thread.start()
        self._threads.append(thread)

    def _run(self, started: float) -> None:
        offset = self.first
        while not self._stop.wait(max(0.0, started + offset - time.monotonic())):
            serving = self.cluster.active_nodes()
            if serving:
                name = serving[0].name
                self.cluster.preempt(name, self.grace)
                timer = threading.Timer(self.grace, self.cluster.terminate, args=(name,))
                timer.daemon = True
                timer.start()
                self.notices.append(time.monotonic() - started)
                joiner = threading.Thread(target=self.cluster.add_standby, daemon=True)
                joiner.start()
                self._threads.append(joiner)
            offset += self.interval

    def stop(self) -> None:
        """No more notices; waits for the standbys that were joining."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=SETTLE_TIMEOUT_SECONDS)


def settle(cluster: LocalCluster, nodes: int) -> None:
    """Until ``nodes`` nodes can serve (a serving node and a loaded standby)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_SECONDS
    while len(cluster.active_nodes()) < nodes:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the cluster did not settle at {nodes} nodes")
        time.sleep(POLL_SECONDS)


def run_job(
    cluster: LocalCluster,
    front: BatchFront,
    lines: list[dict[str, Any]],
    rolling: Rolling | None,
    progress: Progress,
    description: str,
) -> dict[str, Any]:
    task = progress.add_task(description, total=len(lines))
    started = time.monotonic()
    batch_id = front.submit(lines)
    if rolling is not None:
        rolling.start(started)
    try:
        while True:
            job = front.job(batch_id)
            counts = job["request_counts"]
            progress.update(task, completed=counts["completed"] + counts["failed"])
            if job["status"] in FINISHED:
                break
            if time.monotonic() - started > JOB_TIMEOUT_SECONDS:
                raise RuntimeError(f"job {batch_id} stuck at {counts} ({job['status']})")
            time.sleep(POLL_SECONDS)
        seconds = time.monotonic() - started
    finally:
        if rolling is not None:
            rolling.stop()
    if job["status"] != "completed" or job["request_counts"]["failed"]:
        raise RuntimeError(f"job {batch_id} ended {job['status']}: {job['request_counts']}")
    results = front.output(str(job["output_file_id"]))
    tokens = sum(int(r["response"]["body"]["usage"]["completion_tokens"]) for r in results)
    asked = sum(int(line["body"]["max_tokens"]) for line in lines)
    extra = job.get("spotinfer", {})
    return {
        "batch_id": batch_id,
        "lines": len(results),
        "completion_tokens": tokens,
        "asked_tokens": asked,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "notices_at_seconds": list(rolling.notices) if rolling is not None else [],
        "migrated_lines": int(extra.get("migrated_lines", 0)),
        "recomputed_tokens": int(extra.get("recomputed_tokens", 0)),
        "restarted_lines": int(extra.get("restarted_lines", 0)),
    }


def measure(args: Any, model: str) -> dict[str, Any]:
    config = ClusterConfig(
        model=model,
        workers=1,
        standbys=1,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        memory_gib=args.memory_gib,
        coordinator_flags=("--record-retention-seconds", "1"),
        log_dir=args.log_dir,
    )
    low, high = (int(x) for x in args.output_tokens.split(","))
    rounds: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    with LocalCluster(config) as cluster, Progress() as progress:
        front = BatchFront(cluster)
        for r in range(args.rounds):
            for side in rotated(SIDES, r):
                settle(cluster, 2)
                lines = job_lines(args.lines, (low, high), args.seed + r, f"r{r}-{side}")
                rolling = (
                    Rolling(cluster, args.first, args.interval, args.grace)
                    if side == "rolling"
                    else None
                )
                result = run_job(cluster, front, lines, rolling, progress, f"round {r + 1}: {side}")
                rounds[side].append(result)
                if result["completion_tokens"] != result["asked_tokens"]:
                    raise RuntimeError(f"{side}: tokens {result} differ from those asked")

    def med(side: str, key: str) -> float:
        return float(statistics.median(run[key] for run in rounds[side]))

    return {
        "model": model,
        "lines": args.lines,
        "output_tokens": [low, high],
        "rolling": {"first_s": args.first, "interval_s": args.interval, "grace_s": args.grace},
        "median": {
            side: {
                key: med(side, key)
                for key in ("tokens_per_second", "seconds", "migrated_lines", "recomputed_tokens")
            }
            for side in SIDES
        },
        "ratio_rolling_vs_undisturbed": med("rolling", "tokens_per_second")
        / med("undisturbed", "tokens_per_second"),
        "rounds": rounds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, rounds=1, dtype="bfloat16")
    parser.add_argument("--lines", type=int, default=192)
    parser.add_argument("--output-tokens", default="96,160", help="range low,high")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=float, default=15.0, help="first notice, s")
    parser.add_argument("--interval", type=float, default=30.0, help="between notices, s")
    parser.add_argument("--grace", type=float, default=8.0, help="each notice's grace, s")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--memory-gib", type=float, default=1.0, help="per worker")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/batch-preemptions"))
    args = parser.parse_args(argv)
    model = resolve_model_arg(args.model)
    result = measure(args, model)
    write_json(args.json, result)
    console = Console()
    rows = [
        [
            side,
            f"{run['tokens_per_second']:.1f}",
            f"{run['seconds']:.1f}",
            str(len(run["notices_at_seconds"])),
            str(run["migrated_lines"]),
            str(run["recomputed_tokens"]),
            str(run["restarted_lines"]),
        ]
        for side in SIDES
        for run in result["rounds"][side]
    ]
    columns = ["job", "tokens/s", "seconds", "notices", "moved", "recomputed", "restarted"]
    print_table(console, "Batch job under rolling preemptions", columns, rows)
    console.print(f"rolling / undisturbed = {result['ratio_rolling_vs_undisturbed']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
