"""Real processes for the noticed-preemption tests: a redis-server, a standby worker B, and
per scenario a worker A with its context daemon watching a local metadata server."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from spotinfer.local.daemon_process import DaemonProcess
from spotinfer.local.metadata_servers import MetadataServer
from spotinfer.local.worker_process import WorkerProcess
from tests.resume.conftest import MAX_MODEL_LEN
from tests.support.redis_server import RedisServer

DAEMON_POLL_SECONDS = "0.2"


def worker_flags(redis_url: str, policy: str) -> tuple[str, ...]:
    return (
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--memory-gib",
        "0.25",
        "--redis-url",
        redis_url,
        "--kv-persist-policy",
        policy,
    )


@dataclass
class Node:
    """A spot VM as the tests build it: worker A, its daemon, and its metadata service."""

    worker_id: str
    worker: WorkerProcess
    daemon: DaemonProcess
    metadata: MetadataServer


@pytest.fixture(scope="package")
def standby(
    tiny_model: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """Worker B: resumes what the preempted workers paused."""
    with WorkerProcess(
        tiny_model,
        *worker_flags(redis_server.url, "eager"),
        "--worker-id",
        "worker-b",
        log_dir=tmp_path_factory.mktemp("standby-logs"),
    ) as process:
        yield process


def start_node(
    stack: ExitStack,
    tiny_model: Path,
    redis_url: str,
    policy: str,
    worker_id: str,
    metadata: MetadataServer,
    source: str,
    log_dir: Path,
) -> Node:
    """Worker A listening on TCP and a unix socket; its daemon reaches it by the socket."""
    socket_path = log_dir / "worker.sock"
    stack.enter_context(metadata)
    worker = stack.enter_context(
        WorkerProcess(
            tiny_model,
            *worker_flags(redis_url, policy),
            "--worker-id",
            worker_id,
            "--unix-socket",
            str(socket_path),
            log_dir=log_dir,
        )
    )
    daemon = stack.enter_context(
        DaemonProcess(
            "--notice-source",
            source,
            "--metadata-url",
            metadata.base_url,
            "--worker-address",
            f"unix:{socket_path}",
            "--redis-url",
            redis_url,
            "--poll-interval-seconds",
            DAEMON_POLL_SECONDS,
            "--daemon-id",
            f"daemon-of-{worker_id}",
            log_dir=log_dir,
        )
    )
    return Node(worker_id, worker, daemon, metadata)
