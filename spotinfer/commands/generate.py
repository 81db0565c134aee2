"""`spotinfer generate` streams an answer; `spotinfer status` shows the cluster."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from common.errors import UserError

DEFAULT_TARGET = "127.0.0.1:50051"


def register(subparsers: Any) -> None:
    generate: argparse.ArgumentParser = subparsers.add_parser(
        "generate", help="stream an answer from a cluster's coordinator"
    )
    generate.add_argument("prompt")
    generate.add_argument(
        "--target",
        action="append",
        default=None,
        help=f"coordinator HOST:PORT; repeat for replicas (default {DEFAULT_TARGET})",
    )
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--sla", choices=("interactive", "batch"), default="interactive")
    generate.add_argument("--request-id", default=None)
    _access_arguments(generate)
    generate.set_defaults(func=run_generate)

    status: argparse.ArgumentParser = subparsers.add_parser(
        "status", help="workers, queues and in-flight requests of a cluster"
    )
    status.add_argument("--target", default=DEFAULT_TARGET, help="coordinator HOST:PORT")
    _access_arguments(status)
    status.set_defaults(func=run_status)


def _access_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ca-file",
        default=os.environ.get("SPOTINFER_CA_FILE", ""),
        help="the cluster CA, to reach a coordinator over TLS (env SPOTINFER_CA_FILE)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SPOTINFER_API_KEY", ""),
        help="API key (env SPOTINFER_API_KEY; status needs an admin key)",
    )


def _unreachable(target: str, exc: Any) -> UserError:
    return UserError(f"cannot reach a coordinator at {target}: {exc.details() or exc.code().name}")


def run_generate(args: argparse.Namespace) -> int:
    import grpc

    from common.requests import Sampling, SlaClass
    from spotinfer.client import Client, ClientConfig

    targets = tuple(args.target or [DEFAULT_TARGET])
    sampling = Sampling(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    sla = SlaClass.BATCH if args.sla == "batch" else SlaClass.INTERACTIVE
    client = Client(
        ClientConfig(
            targets=targets, reconnect_attempts=3, ca_file=args.ca_file, api_key=args.api_key
        )
    )
    try:
        for chunk in client.stream(args.prompt, sampling, sla, args.request_id):
            if chunk.event is not None:
                print(f"\n[{chunk.event.kind.name.lower()}: {chunk.event.detail}]", file=sys.stderr)
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        print()
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:  # type: ignore[attr-defined]
            raise _unreachable(", ".join(targets), exc) from exc
        raise UserError(f"{exc.code().name}: {exc.details()}") from exc  # type: ignore[attr-defined]
    finally:
        client.close()
    return 0


def run_status(args: argparse.Namespace) -> int:
    import grpc
    from rich.console import Console
    from rich.table import Table

    from common.channels import PLAINTEXT, TransportConfig, sync_channel
    from protos.convert import kv_persistence_from_proto
    from protos.spotinfer.v1 import common_pb2, control_pb2, control_pb2_grpc

    transport = TransportConfig(ca_file=args.ca_file) if args.ca_file else PLAINTEXT
    with sync_channel(args.target, transport=transport, api_key=args.api_key) as channel:
        try:
            status = control_pb2_grpc.ControlStub(channel).ClusterStatus(
                control_pb2.ClusterStatusRequest(), timeout=5
            )
        except grpc.RpcError as exc:
            raise _unreachable(args.target, exc) from exc
    console = Console()
    workers = Table(title=f"workers at {args.target}")
    columns = ("worker", "address", "role", "state", "running", "waiting", "KV free", "tok/s")
    for column in (*columns, "KV persist"):
        workers.add_column(column)
    for w in status.workers:
        workers.add_row(
            w.worker_id,
            w.address,
            control_pb2.WorkerRole.Name(w.role).removeprefix("WORKER_ROLE_").lower(),
            control_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower(),
            str(w.stats.running_seqs),
            str(w.stats.waiting_seqs),
            f"{w.stats.kv_blocks_free}/{w.stats.kv_blocks_total}",
            f"{w.stats.tokens_per_second:.1f}",
            kv_persistence_from_proto(w.stats.kv_persistence).label,
        )
    console.print(workers)
    queues = Table(title="queues")
    for column in ("class", "depth", "capacity", "running"):
        queues.add_column(column)
    for q in status.queues:
        name = common_pb2.SlaClass.Name(q.sla_class).removeprefix("SLA_CLASS_").lower()
        queues.add_row(name, str(q.depth), str(q.capacity), str(q.running))
    console.print(queues)
    if status.batch_jobs:
        jobs = Table(title="batch jobs")
        for column in ("batch", "tenant", "status", "done", "failed", "progress"):
            jobs.add_column(column)
        for job in status.batch_jobs:
            done = job.completed + job.failed
            share = f"{100 * done / job.total:.0f}%" if job.total else "-"
            jobs.add_row(
                job.batch_id, job.tenant, job.status, f"{done}/{job.total}", str(job.failed), share
            )
        console.print(jobs)
    _print_caps(console, status)
    console.print(f"in flight: {status.in_flight}; standbys ready: {status.standbys_ready}")
    _print_persistence(console, status)
    return 0


def _print_persistence(console: Any, status: Any) -> None:
    """The cluster's KV persistence policy, or why there is none."""
    from rich.markup import escape

    from protos.convert import kv_persistence_from_proto

    if status.kv_persistence_warning:
        console.print(f"[bold yellow]warning:[/] {escape(status.kv_persistence_warning)}")
        return
    label = kv_persistence_from_proto(status.kv_persistence).label
    console.print(f"KV persistence: {label if status.kv_persistence.policy else 'not reported'}")


def _print_caps(console: Any, status: Any) -> None:
    """Each worker's admission cap per class and the batch controller's last decision."""
    from rich.table import Table

    from protos.spotinfer.v1 import common_pb2

    caps = Table(title="admission caps (batch controller)")
    for column in ("worker", "class", "cap", "decision", "TTFT p99", "TPOT", "why"):
        caps.add_column(column)
    for w in status.workers:
        for c in w.admission_caps:
            caps.add_row(
                w.worker_id,
                common_pb2.SlaClass.Name(c.sla_class).removeprefix("SLA_CLASS_").lower(),
                str(c.cap) if c.cap else "none",
                c.decision,
                f"{c.ttft_p99_seconds * 1000:.0f} ms" if c.ttft_p99_seconds else "-",
                f"{c.tpot_seconds * 1000:.1f} ms" if c.tpot_seconds else "-",
                c.reason,
            )
    console.print(caps)
