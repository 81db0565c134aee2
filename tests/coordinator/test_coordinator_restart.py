"""Acceptance: a request survives its coordinator. Streams run through coordinator C1 to
workers that persist to Redis; C1 is SIGKILLed mid-stream. The workers, seeing their caller
gone, pause and persist each request instead of cancelling it. The clients (spotinfer's own
`Client`, which re-attaches by itself) then reach either C1 restarted on the same port, or a
second replica C2 on the same Redis; that coordinator finds the request's route record,
resumes it on a worker, and every client gets a complete, exactly-once stream equal to an
uninterrupted run. A request relayed by a live replica can be attached on the other.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from common.requests import EventKind, FinishReason, Sampling
from protos.spotinfer.v1 import control_pb2, inference_pb2
from spotinfer.client import Client, ClientConfig
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.worker_process import WorkerProcess
from tests.coordinator.conftest import assemble, greedy, health_of
from tests.coordinator.streams import STREAM_TIMEOUT_SECONDS, WAIT_SECONDS
from tests.support import client_streams
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until

STREAMS = 4
MAX_TOKENS = 900  # long enough that no stream ends before the kill
KILL_AFTER_TOKENS = 60
PROMPTS = [[11 + 3 * i + 7 * j for j in range(24)] for i in range(STREAMS)]


class ClientStream(client_streams.ClientStream):
    def check_exactly_once(self) -> None:
        expected = 0
        for chunk in self.chunks:
            if chunk.token_ids:
                assert chunk.index == expected, f"{self.request_id}: index {chunk.index}"
                expected += len(chunk.token_ids)


@pytest.fixture(scope="module")
def persisting_workers(
    tiny_model: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[WorkerProcess]]:
    log_dir = tmp_path_factory.mktemp("restart-logs")
    flags = (
        *("--dtype", "float32", "--max-model-len", "1024", "--memory-gib", "0.25"),
        *("--redis-url", redis_server.url, "--kv-persist-policy", "eager"),
    )
    processes = [
        WorkerProcess(tiny_model, *flags, "--worker-id", f"p{i}", log_dir=log_dir) for i in range(2)
    ]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: p.start(), processes))
        yield processes
    finally:
        for process in processes:
            if process.process is not None:
                process.stop()


def _coordinator(
    workers: list[WorkerProcess],
    redis_url: str,
    log_dir: Path,
    port: int | None = None,
    extra: tuple[str, ...] = (),
) -> CoordinatorProcess:
    flags = [f for w in workers for f in ("--worker", w.address)]
    process = CoordinatorProcess(
        *flags,
        *extra,
        *("--failover-policy", "resume"),
        *("--redis-url", redis_url),
        *("--heartbeat-interval-seconds", "0.5"),
        log_dir=log_dir,
        port=port,
    )
    process.start()

    def serving() -> bool:
        try:
            return health_of(process) == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:  # a port just given up by a killed process may refuse at first
            return False

    wait_until(serving, "the coordinator SERVING", timeout=60)
    return process


def _kill(process: CoordinatorProcess) -> None:
    assert process.process is not None
    os.killpg(process.process.pid, signal.SIGKILL)
    process.process.wait(10)


def _references(workers: list[WorkerProcess], tag: str) -> list[list[int]]:
    """Uninterrupted runs, straight from a worker."""
    return [
        assemble(
            list(
                workers[0].stub.Generate(
                    greedy(prompt, MAX_TOKENS, f"{tag}-reference-{i}"), timeout=120
                )
            )
        )
        for i, prompt in enumerate(PROMPTS)
    ]


def _stream_all(
    targets: tuple[str, ...], tag: str
) -> tuple[list[ClientStream], list[threading.Thread]]:
    streams = [ClientStream(f"{tag}-{i}") for i in range(STREAMS)]
    config = ClientConfig(targets=targets, reconnect_attempts=400)
    return streams, client_streams.start_streams(streams, PROMPTS, config, MAX_TOKENS)


def _check(streams: list[ClientStream], references: list[list[int]], cut: list[int]) -> None:
    for stream, reference, at_kill in zip(streams, references, cut, strict=True):
        rid = stream.request_id
        assert stream.error is None, f"{rid}: {stream.error!r}"
        assert stream.chunks[-1].finish_reason == FinishReason.LENGTH, rid
        stream.check_exactly_once()
        assert stream.token_ids == reference, f"{rid}: differs from the uninterrupted run"
        assert at_kill < MAX_TOKENS, f"{rid} had finished before the kill: proves nothing"
        kinds = [c.event.kind for c in stream.chunks if c.event is not None]
        # Resumed from the store with its KV: a MIGRATED event (the worker paused it).
        assert EventKind.MIGRATED in kinds, f"{rid}: {kinds}"


def _run_with_kill(
    first: CoordinatorProcess, targets: tuple[str, ...], tag: str, after_kill: object
) -> tuple[list[ClientStream], list[int]]:
    streams, threads = _stream_all(targets, tag)
    wait_until(
        lambda: (
            all(len(s.token_ids) >= KILL_AFTER_TOKENS for s in streams)
            or any(s.error or (s.chunks and s.chunks[-1].finished) for s in streams)
        ),
        f"every stream past {KILL_AFTER_TOKENS} tokens",
        timeout=WAIT_SECONDS,
    )
    _kill(first)
    cut = [len(s.token_ids) for s in streams]
    if callable(after_kill):
        after_kill()
    for thread in threads:
        thread.join(STREAM_TIMEOUT_SECONDS)
    assert not any(thread.is_alive() for thread in threads), "a stream never ended"
    return streams, cut


def test_restarted_coordinator_resumes_every_stream(
    persisting_workers: list[WorkerProcess], redis_server: RedisServer, tmp_path: Path
) -> None:
    references = _references(persisting_workers, "restart")
    first = _coordinator(persisting_workers, redis_server.url, tmp_path)
    restarted: list[CoordinatorProcess] = []
    try:
        streams, cut = _run_with_kill(
            first,
            (first.address,),
            "restart",
            lambda: restarted.append(
                _coordinator(persisting_workers, redis_server.url, tmp_path, port=first.port)
            ),
        )
    finally:
        for process in restarted:
            process.stop()
    _check(streams, references, cut)
    assert "adopted" in restarted[0].output


def test_second_replica_serves_attach_and_survives_the_first(
    persisting_workers: list[WorkerProcess], redis_server: RedisServer, tmp_path: Path
) -> None:
    references = _references(persisting_workers, "replica")
    first = _coordinator(persisting_workers, redis_server.url, tmp_path)
    second = _coordinator(persisting_workers, redis_server.url, tmp_path)
    try:
        # Started on the first, attached on the second (which proxies to the first).
        done = list(first.inference.Generate(greedy(PROMPTS[0], 40, "replica-attach"), timeout=60))
        assert assemble(done) == references[0][:40]
        attached = list(
            second.inference.Attach(
                inference_pb2.AttachRequest(request_id="replica-attach", from_index=10),
                timeout=60,
            )
        )
        assert [t for r in attached for t in r.token_ids] == references[0][10:40]
        with pytest.raises(grpc.RpcError) as unknown:
            list(
                second.inference.Attach(inference_pb2.AttachRequest(request_id="nope"), timeout=10)
            )
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        streams, cut = _run_with_kill(first, (first.address, second.address), "replica", None)
    finally:
        first.stop()
        second.stop()
    _check(streams, references, cut)
    assert "adopted" in second.output


def test_a_request_still_queued_when_its_coordinator_died_is_submitted_again(
    persisting_workers: list[WorkerProcess], redis_server: RedisServer, tmp_path: Path
) -> None:
    """It never reached a worker, so nothing of it is anywhere to attach to: the client
    submits it again under its id, and it runs once, from the start."""
    workers, one_slot = persisting_workers[:1], ("--max-seqs-per-worker", "1")
    reference = _references(workers, "queued")[1]
    first = _coordinator(workers, redis_server.url, tmp_path, extra=one_slot)
    restarted: list[CoordinatorProcess] = []
    holder = first.inference.Generate(greedy(PROMPTS[0], MAX_TOKENS, "queued-holder"), timeout=60)
    next(holder)  # it holds the only slot
    queued = ClientStream("queued-1")

    def read() -> None:
        config = ClientConfig(targets=(first.address,), reconnect_attempts=400)
        try:
            with Client(config) as client:
                sampling = Sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                for chunk in client.stream(PROMPTS[1], sampling, request_id=queued.request_id):
                    queued.chunks.append(chunk)
        except BaseException as exc:  # reported by the test
            queued.error = exc

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_until(
            lambda: _queued(first) == 1, "the request queued behind the holder", WAIT_SECONDS
        )
        _kill(first)
        holder.cancel()
        restarted.append(
            _coordinator(workers, redis_server.url, tmp_path, port=first.port, extra=one_slot)
        )
        reader.join(STREAM_TIMEOUT_SECONDS)
    finally:
        for process in restarted:
            process.stop()
    assert not reader.is_alive(), "the stream never ended"
    assert queued.error is None, f"{queued.error!r}"
    assert queued.chunks[-1].finish_reason == FinishReason.LENGTH
    queued.check_exactly_once()
    assert queued.token_ids == reference


def _queued(process: CoordinatorProcess) -> int:
    status = process.control.ClusterStatus(control_pb2.ClusterStatusRequest(), timeout=10)
    return sum(queue.depth for queue in status.queues)
