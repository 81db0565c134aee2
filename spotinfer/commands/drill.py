"""`spotinfer up` runs a local cluster; `spotinfer drill SCENARIO` proves it under fire."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import time
from pathlib import Path
from typing import Any

from common.errors import UserError
from worker.constants import KV_PERSIST_POLICIES

CLOUD_CHOICES = ("aws", "gcp", "azure")
SAMPLING_CHOICES = ("greedy", "seeded")  # spotinfer.loadgen.Sampling (imported when run)


def _cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model folder or name")
    parser.add_argument("--workers", type=int, default=1, help="active workers")
    parser.add_argument("--standbys", type=int, default=1, help="warm standby workers")
    parser.add_argument("--cloud", choices=CLOUD_CHOICES, default="aws", help="notice format")
    parser.add_argument(
        "--notice-seconds",
        type=float,
        default=0.0,
        help="gcp: the VMs' preemption notice length, told to their daemons (a GCP notice "
        "carries no deadline); 0: 30 s",
    )
    parser.add_argument("--redis-url", default="", help="use this Redis instead of our own")
    parser.add_argument(
        "--redis-cluster-masters",
        type=int,
        default=0,
        help="our own store as a Redis Cluster of this many masters (at least 3; TLS and ACL "
        "users on every node, every process given --redis-cluster); 0: one redis-server",
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--memory-gib", type=float, default=1.0, help="per worker")
    parser.add_argument(
        "--kv-persist-policy",
        choices=KV_PERSIST_POLICIES,
        default="eager",
        help="the workers' KV persistence: eager (every block as it fills), lazy (all at a "
        "notice), hybrid (as they fill up to --kv-persist-rate-mb-s, the rest at a notice), "
        "off",
    )
    parser.add_argument(
        "--kv-persist-rate-mb-s",
        type=float,
        default=None,
        help="hybrid's cap: MB/s of KV blocks written as they fill (required by hybrid only)",
    )
    parser.add_argument(
        "--kv-writer",
        choices=("daemon", "worker"),
        default="daemon",
        help="who writes the KV blocks to Redis: each node's daemon, handed them through "
        "shared memory (a crash of the worker process loses none), or the worker itself",
    )
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/spotinfer-cluster"))
    parser.add_argument(
        "--zones",
        default="",
        help="spread the spot nodes over these zones (comma-separated, e.g. a,b); each node's "
        "pool labels name its zone",
    )
    parser.add_argument(
        "--fallback-nodes",
        type=int,
        default=0,
        help="on-demand fallback nodes: routed to only while the spot nodes cannot hold the "
        "load; never noticed by a drill",
    )


def register(subparsers: Any) -> None:
    up: argparse.ArgumentParser = subparsers.add_parser(
        "up", help="a whole cluster on this machine: redis, coordinator, workers with daemons"
    )
    _cluster_arguments(up)
    up.add_argument("--port", type=int, default=50051, help="coordinator gRPC port")
    up.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP port")
    up.set_defaults(func=run_up)

    drill: argparse.ArgumentParser = subparsers.add_parser(
        "drill", help="a chaos preemption drill with a verdict on every invariant"
    )
    drill.add_argument(
        "scenario",
        help="notice | sigterm | drain | scale-in (aws) | abrupt | redis-restart | coordinator-restart "
        "| rolling | storm | correlated | zone (--zones a,b) | trace",
    )
    _cluster_arguments(drill)
    drill.add_argument("--policy", choices=("spotinfer", "reroute"), default="spotinfer")
    drill.add_argument(
        "--target",
        default=None,
        help="an existing cluster's coordinator "
        "(HOST:PORT); only its status is read, drills need a local cluster",
    )
    drill.add_argument("--requests", type=int, default=16)
    drill.add_argument("--rate", type=float, default=0.0, help="requests/s; 0: all at once")
    drill.add_argument("--output-tokens", default="200,300", help="range low,high")
    drill.add_argument("--time-scale", type=float, default=1.0)
    drill.add_argument("--grace-seconds", type=float, default=None)
    drill.add_argument("--interval", type=float, default=30.0, help="rolling: seconds")
    drill.add_argument("--duration", type=float, default=300.0, help="rolling: seconds")
    drill.add_argument(
        "--first-notice",
        type=float,
        default=None,
        help="rolling: seconds after the load starts (default: once requests are mid-stream)",
    )
    drill.add_argument("--seed", type=int, default=0, help="the planned load's seed")
    drill.add_argument(
        "--sampling",
        choices=SAMPLING_CHOICES,
        default=SAMPLING_CHOICES[0],
        help="greedy, or seeded: temperature 1 with a seed per request; either way each "
        "output must equal an undisturbed run's",
    )
    drill.add_argument("--trace", type=Path, default=None, help="trace: SpotServe-format file")
    drill.add_argument("--json", type=Path, default=None, help="write the report here")
    drill.add_argument("--png", type=Path, default=Path("drill-timeline.png"))
    drill.set_defaults(func=run_drill_command)


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _resolve_model(name: str) -> str:
    from spotinfer.models.smollm2 import resolve_model

    model = str(resolve_model(name))
    if not Path(model, "config.json").exists():
        raise UserError(f"model {name!r}: no such model folder (need config.json)")
    return model


def _config(args: argparse.Namespace, **extra: Any) -> Any:
    from spotinfer.local.cluster import ClusterConfig

    try:
        return ClusterConfig(
            model=_resolve_model(args.model),
            workers=args.workers,
            standbys=args.standbys,
            cloud=args.cloud,
            notice_seconds=args.notice_seconds,
            redis_url=args.redis_url,
            redis_cluster_masters=args.redis_cluster_masters,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            memory_gib=args.memory_gib,
            persist_policy=args.kv_persist_policy,
            persist_rate_mb_s=args.kv_persist_rate_mb_s,
            kv_handoff=args.kv_writer == "daemon",
            log_dir=args.log_dir,
            zones=tuple(z.strip() for z in args.zones.split(",")) if args.zones else (),
            fallback_nodes=args.fallback_nodes,
            **extra,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from exc


def run_up(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from spotinfer.local.cluster import LocalCluster

    for port in (args.port, args.http_port):
        if not _port_free(port):
            raise UserError(f"port {port} is in use; pick another with --port / --http-port")
    config = _config(
        args,
        port=args.port,
        http_port=args.http_port,
        coordinator_flags=("--record-retention-seconds", "5"),
    )
    console = Console()
    stopping = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stopping.update(now=True))
    with console.status("starting the cluster ..."):
        cluster = LocalCluster(config, console.print).start()
    try:
        access = ""
        if cluster.client_transport.tls:
            access = f" --ca-file {cluster.client_transport.ca_file} --api-key {cluster.api_key}"
        console.print(
            f"[bold]ready[/]: gRPC {cluster.coordinator.address}, HTTP {cluster.coordinator.http_url}"
            f" — try `spotinfer generate --target {cluster.coordinator.address}{access}"
            ' "Hello"`; Ctrl-C stops everything'
        )
        with Live(_status_table(cluster), console=console, refresh_per_second=1) as live:
            while not stopping["now"]:
                time.sleep(1.0)
                live.update(_status_table(cluster))
    except KeyboardInterrupt:
        pass
    finally:
        with console.status("stopping ..."):
            cluster.stop()
    console.print("stopped; no process left behind")
    return 0


def _status_table(cluster: Any) -> Any:
    from rich.table import Table

    from protos.spotinfer.v1 import control_pb2

    table = Table(title="spotinfer cluster")
    for column in ("node", "worker", "role", "state", "running", "waiting", "KV free", "tok/s"):
        table.add_column(column)
    try:
        status = cluster.coordinator.control.ClusterStatus(
            control_pb2.ClusterStatusRequest(), timeout=2
        )
    except Exception as exc:  # the table says so rather than the status loop dying
        table.caption = f"coordinator not answering: {exc}"
        return table
    for w in status.workers:
        table.add_row(
            w.worker_id,
            w.address,
            control_pb2.WorkerRole.Name(w.role).removeprefix("WORKER_ROLE_").lower(),
            control_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower(),
            str(w.stats.running_seqs),
            str(w.stats.waiting_seqs),
            f"{w.stats.kv_blocks_free}/{w.stats.kv_blocks_total}",
            f"{w.stats.tokens_per_second:.1f}",
        )
    table.caption = f"in flight {status.in_flight}, standbys ready {status.standbys_ready}"
    return table


def run_drill_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from spotinfer.drills.report import verdict_table
    from spotinfer.drills.runner import DrillOptions, plan, run_drill
    from spotinfer.drills.scenarios import Scenario
    from spotinfer.loadgen import Sampling
    from spotinfer.local.cluster import LocalCluster

    if args.scenario not in Scenario.registry:
        raise UserError(
            f"unknown scenario {args.scenario!r}; known: {', '.join(sorted(Scenario.registry))}"
        )
    if args.target:
        raise UserError(
            "drills start their own local cluster (they need its metadata servers and "
            "processes); for a cloud fleet use `spotinfer fleet drill`"
        )
    if args.scenario == "trace" and (args.trace is None or not args.trace.exists()):
        raise UserError("the trace scenario needs --trace FILE (an existing file)")
    try:
        low, high = (int(v) for v in args.output_tokens.split(","))
    except ValueError as exc:
        raise UserError(f"--output-tokens must be low,high, got {args.output_tokens!r}") from exc
    if args.grace_seconds is not None and args.cloud == "gcp":
        raise UserError(
            "a GCP notice carries no deadline, so --grace-seconds cannot be honoured: "
            "give --notice-seconds (the VMs' notice length, told to their daemons)"
        )
    scenario = Scenario.registry[args.scenario]
    standbys = max(args.standbys, scenario.needs_standbys)
    options = DrillOptions(
        scenario=args.scenario,
        requests=args.requests,
        rate_per_second=args.rate,
        output_tokens=(low, high),
        time_scale=args.time_scale,
        grace_seconds=args.grace_seconds,
        interval_seconds=args.interval,
        duration_seconds=args.duration,
        trace_file=args.trace,
        first_disturbance_seconds=args.first_notice,
        seed=args.seed,
        sampling=Sampling(args.sampling),
    )
    args.standbys = standbys
    config = _config(
        args, policy=args.policy, coordinator_flags=("--record-retention-seconds", "1")
    )
    console = Console()
    vocab = int(json.loads(Path(config.model, "config.json").read_text())["vocab_size"])
    planned = plan(options, vocab)
    with console.status("starting the cluster ..."):
        cluster = LocalCluster(config, console.print).start()
    try:
        console.print(f"drill [bold]{args.scenario}[/] ({args.policy}): {len(planned)} requests")
        started = time.monotonic()
        outcome = run_drill(cluster, options, planned, png=args.png, say=console.print)
        console.print(f"drill took {time.monotonic() - started:.0f} s")
    finally:
        cluster.stop()
    console.print(verdict_table(outcome.report))
    report = outcome.report
    console.print(
        f"requests {report.requests}, p50 {report.p50_ms:.0f} ms, p99 {report.p99_ms:.0f} ms, "
        f"migrations {report.migrations}, recoveries {report.recoveries}, "
        f"recomputed tokens {report.recomputed_tokens}"
    )
    if args.json:
        report.write_json(args.json)
        console.print(f"report: {args.json}")
    if outcome.png:
        console.print(f"timeline: {outcome.png}")
    return 0 if report.verdict == "PASS" else 1
