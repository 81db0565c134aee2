"""A notice, then Redis unreachable from both nodes: the requests migrate peer to peer.

Two nodes, each a worker handing its KV to its daemon (`--kv-handoff-socket`) and each
reaching Redis only through a link of its own (tests/support/tcp_link.py); a coordinator in
front. Greedy streams run past their first stored chunk; the coordinator is told the source
is noticed (Control.InjectNotice) and both links are cut at once: from then on neither node
can read or write Redis. The source's daemon, holding every block its worker handed over,
pushes each paused request's KV to the target's daemon (PushBlocks), which lays it out for
its worker; the coordinator resumes each request there from what its client received. Every
stream must end exactly once, equal to an uninterrupted run, migrated with 0 recomputed.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import pytest

from protos.spotinfer.v1 import common_pb2, control_pb2
from spotinfer.local.daemon_process import DaemonProcess
from spotinfer.local.worker_process import WorkerProcess
from tests.coordinator.conftest import WORKER_FLAGS, start_coordinator
from tests.coordinator.streams import StreamTrace, join_all, offline_reference, read_streams
from tests.support.redis_server import RedisServer
from tests.support.tcp_link import TcpLink
from tests.support.wait import wait_until

STREAMS = 4
PROMPT_TOKENS = 40
# Long enough that every stream still runs when the pause comes: the notice's staging step
# (which fails here, Redis being cut) may take seconds on a loaded machine, and the tiny model
# decoded the rest of 900 tokens in under 2 s, finishing all four on the source first.
MAX_TOKENS = 1900
PAST_FIRST_CHUNK = 240  # output tokens: the first 256-token chunk is stored (at 216)
MAX_MODEL_LEN = 2048
SOURCE, TARGET = "peer-source", "peer-target"


def _prompts() -> list[list[int]]:
    return [[10 + (11 * i + 7 * j) % 480 for j in range(PROMPT_TOKENS)] for i in range(STREAMS)]


def _node(
    stack: ExitStack, tiny_model: Path, name: str, link: TcpLink, log_dir: Path
) -> tuple[WorkerProcess, DaemonProcess, Path]:
    """A worker and its daemon, both reaching Redis through ``link`` only."""
    here = Path(tempfile.mkdtemp(prefix=f"spot-{name[-6:]}-"))  # unix socket paths are short
    stack.callback(shutil.rmtree, here, True)
    peer_dir = here / "peer"
    shared = (
        *("--redis-url", link.url),
        *("--kv-handoff-socket", str(here / "handoff.sock")),
        *("--kv-peer-staging-dir", str(peer_dir)),
    )
    worker = WorkerProcess(
        tiny_model,
        *WORKER_FLAGS,
        *("--max-model-len", str(MAX_MODEL_LEN)),  # over WORKER_FLAGS' 1024
        *shared,
        *("--worker-id", name),
        log_dir=log_dir,
    )
    daemon = DaemonProcess(
        *("--notice-source", "file", "--notice-file", str(here / "notice")),
        *shared,
        *("--worker-address", worker.address, "--daemon-id", f"daemon-of-{name}"),
        log_dir=log_dir,
    )
    stack.callback(worker.stop)
    stack.callback(daemon.stop)
    return worker, daemon, peer_dir


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def test_a_notice_then_no_redis_migrates_peer_to_peer(
    tiny_model: Path, redis: RedisServer, tmp_path: Path
) -> None:
    prompts = _prompts()
    references = offline_reference(tiny_model, prompts, MAX_TOKENS, MAX_MODEL_LEN, tmp_path)
    with ExitStack() as stack:
        links = [stack.enter_context(TcpLink(redis.port)) for _ in range(2)]
        source, source_daemon, _ = _node(stack, tiny_model, SOURCE, links[0], tmp_path / "a")
        target, target_daemon, target_peer_dir = _node(
            stack, tiny_model, TARGET, links[1], tmp_path / "b"
        )
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda w: w.start(), [source, target]))
        source_daemon.start()
        target_daemon.start()
        coordinator = start_coordinator(
            *("--worker", f"{source.address}={source_daemon.address}"),
            *("--standby", f"{target.address}={target_daemon.address}"),
            *("--failover-policy", "resume"),
            log_dir=tmp_path / "coordinator",
        )
        stack.callback(coordinator.stop)
        traces = [StreamTrace(f"peer-{i}") for i in range(STREAMS)]
        threads = read_streams(coordinator.inference, traces, prompts, MAX_TOKENS)
        wait_until(
            lambda: all(len(t.token_ids) >= PAST_FIRST_CHUNK for t in traces),
            "every stream past its first stored chunk",
            timeout=180,
        )
        coordinator.control.InjectNotice(
            control_pb2.InjectNoticeRequest(
                worker_id=SOURCE, kind=control_pb2.NOTICE_KIND_TERMINATE, grace_seconds=60
            ),
            timeout=10,
        )
        for link in links:
            link.cut()
        at_cut = [len(t.token_ids) for t in traces]
        join_all(threads)

        for trace, reference in zip(traces, references, strict=True):
            assert trace.error is None, trace.error
            assert (trace.duplicates, trace.gaps) == (0, 0), trace.request_id
            assert trace.token_ids == reference, trace.request_id
            migrated = trace.events_of(common_pb2.EVENT_KIND_MIGRATED)
            assert len(migrated) == 1, trace.request_id
            assert migrated[0].to_worker == TARGET
            assert migrated[0].recomputed_tokens == 0, migrated[0].detail
        assert min(at_cut) < MAX_TOKENS, "the streams were running when Redis went away"
        # The KV came daemon to daemon: the target's daemon laid it out for its worker.
        assert any(target_peer_dir.iterdir()), "nothing was pushed to the target's daemon"
