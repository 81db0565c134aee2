"""A worker process crashes while its VM (and its context daemon) lives on: the daemon writes
what the worker had handed over, and the request resumes elsewhere recomputing at most one
stored block.

A coordinator (`--failover-policy resume`) in front of a worker that hands its KV writes to
its daemon (`--kv-handoff-socket`) and a spare. A greedy stream runs past its first stored
chunk; Redis then holds every write (CLIENT PAUSE WRITE: a write waits unanswered, and a
client that gives up on it or dies takes it along) while the worker streams on through two
more chunks, which the worker hands to its daemon; the worker process alone is SIGKILLed and
Redis takes writes again.
The coordinator has the daemon settle, then resumes on the spare: those chunks must be
loaded, not recomputed (a worker that wrote Redis itself loses the last with its write
queue, and recomputes more than a chunk).
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from protos.spotinfer.v1 import common_pb2, daemon_pb2
from spotinfer.local.daemon_process import DaemonProcess
from spotinfer.local.worker_process import WorkerProcess
from tests.coordinator.conftest import WORKER_FLAGS, start_coordinator
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until
from worker.constants import DEFAULT_KV_CHUNK_TOKENS

PROMPT = list(range(60, 100))
MAX_TOKENS = 960
CHUNK = DEFAULT_KV_CHUNK_TOKENS
PAST_FIRST_CHUNK = CHUNK - len(PROMPT) + 60  # output tokens: the first chunk is stored
# Received while Redis holds writes: two more chunks fill, whose writes only the daemon, alive
# and trying again, gets through (a worker writing itself drops them on its socket timeout,
# or dies with them).
FROZEN_TOKENS = 2 * CHUNK + 40
PAUSE_MS = 600_000
TIMEOUT_SECONDS = 300


@pytest.fixture(scope="module")
def paused_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def node(
    tiny_model: Path, paused_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerProcess, DaemonProcess, WorkerProcess]]:
    """The doomed worker with its daemon (sharing a hand-off socket), and a spare."""
    log_dir = tmp_path_factory.mktemp("crash-logs")
    socket_dir = tempfile.mkdtemp(prefix="spot-crash-")  # unix socket paths are short
    handoff = os.path.join(socket_dir, "handoff.sock")
    store = ("--redis-url", paused_redis.url)
    daemon = DaemonProcess(
        *("--notice-source", "file", "--notice-file", os.path.join(socket_dir, "notice")),
        *store,
        *("--kv-handoff-socket", handoff),
        log_dir=log_dir,
    )
    doomed = WorkerProcess(
        tiny_model,
        *WORKER_FLAGS,
        *store,
        *("--kv-handoff-socket", handoff),
        *("--worker-id", "crash-doomed"),
        log_dir=log_dir,
    )
    spare = WorkerProcess(
        tiny_model, *WORKER_FLAGS, *store, *("--worker-id", "crash-spare"), log_dir=log_dir
    )
    processes: list[WorkerProcess | DaemonProcess] = [daemon, doomed, spare]
    try:
        daemon._cmd += ["--worker-address", doomed.address]  # noqa: SLF001 - known only now
        daemon.start()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: p.start(), [doomed, spare]))
        yield doomed, daemon, spare
    finally:
        for process in processes:
            if process.process is not None:
                process.stop()
        if doomed.process is not None:
            # Its engine core outlived the killed process (systemd stops the whole unit; here
            # its process group goes).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(doomed.process.pid, signal.SIGKILL)


def _read(coordinator, request_id: str, into: list, lock: threading.Lock) -> None:  # type: ignore[no-untyped-def]
    request = common_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )
    for response in coordinator.inference.Generate(request, timeout=TIMEOUT_SECONDS):
        with lock:
            into.append(response)


def _tokens(responses: list[common_pb2.GenerateResponse]) -> list[int]:
    output: list[int] = []
    for response in responses:
        if response.token_ids:
            assert response.index == len(output), "exactly once, in order"
            output.extend(response.token_ids)
    return output


def test_a_crashed_worker_process_loses_nothing_its_daemon_had(
    node: tuple[WorkerProcess, DaemonProcess, WorkerProcess],
    paused_redis: RedisServer,
    tmp_path: Path,
) -> None:
    doomed, daemon, spare = node
    coordinator = start_coordinator(
        *("--worker", f"{doomed.address}={daemon.address}", "--standby", spare.address),
        *("--failover-policy", "resume", "--lost-after-seconds", "2"),
        log_dir=tmp_path,
    )
    received: list[common_pb2.GenerateResponse] = []
    lock = threading.Lock()

    def count() -> int:
        with lock:
            return sum(len(r.token_ids) for r in received)

    reader = threading.Thread(
        target=_read, args=(coordinator, "crash-stream", received, lock), daemon=True
    )
    try:
        reader.start()
        wait_until(lambda: count() >= PAST_FIRST_CHUNK, "the stream past its first chunk")
        admin = redis.Redis.from_url(paused_redis.url)
        admin.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
        try:
            before = count()
            wait_until(
                lambda: count() >= before + FROZEN_TOKENS, "two chunks filled, no write taken"
            )
            assert doomed.process is not None
            os.kill(doomed.process.pid, signal.SIGKILL)  # the worker process only
            doomed.process.wait(30)
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")
            admin.close()
        reader.join(TIMEOUT_SECONDS)
        assert not reader.is_alive(), "the stream ended"

        output = _tokens(received)
        assert len(output) == MAX_TOKENS
        assert received[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        events = [r.event for r in received if r.HasField("event")]
        assert [e.kind for e in events] == [common_pb2.EVENT_KIND_RECOVERED]
        assert events[0].recomputed_tokens <= CHUNK, events[0].detail
        status = daemon.stub.Status(daemon_pb2.DaemonStatusRequest(), timeout=10)
        assert status.persisted_bytes > 0, "the daemon wrote the blocks"

        # The same request undisturbed (on the spare, the one worker left): token for token.
        again: list[common_pb2.GenerateResponse] = []
        _read(coordinator, "crash-reference", again, lock)
        assert _tokens(again) == output
    finally:
        coordinator.stop()
