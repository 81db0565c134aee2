"""A worker killed mid-stream (SIGKILL, no notice): with `--failover-policy resume` every
stream it served goes on on the promoted standby, from the persisted state, exactly once
and equal to an uninterrupted run."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from protos.spotinfer.v1 import common_pb2
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.worker_process import WorkerProcess
from tests.coordinator.conftest import (
    TIMEOUT_SECONDS,
    assemble,
    greedy,
    start_coordinator,
    started_workers,
)
from tests.support.redis_server import RedisServer

STREAMS = 4
MAX_TOKENS = 300
PROMPTS = [[5, 17, 42, 99], [7, 8, 9], [100, 200, 300, 44, 55], [61, 62]]


@pytest.fixture(scope="module")
def persisting_workers(
    tiny_model: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[WorkerProcess]]:
    log_dir = tmp_path_factory.mktemp("persisting-logs")
    names = ["doomed", "spare"]
    with started_workers(tiny_model, names, log_dir, "--redis-url", redis_server.url) as pair:
        yield pair


def test_sigkilled_worker_streams_resume_on_the_standby(
    persisting_workers: list[WorkerProcess], tmp_path: Path
) -> None:
    doomed, spare = persisting_workers
    references = [
        assemble(list(spare.stub.Generate(greedy(p, MAX_TOKENS), timeout=TIMEOUT_SECONDS)))
        for p in PROMPTS
    ]
    coordinator: CoordinatorProcess = start_coordinator(
        "--worker",
        doomed.address,
        "--standby",
        spare.address,
        "--failover-policy",
        "resume",
        "--lost-after-seconds",
        "2",
        log_dir=tmp_path,
    )
    try:
        started = threading.Barrier(STREAMS + 1)
        results: list[list[common_pb2.GenerateResponse]] = [[] for _ in range(STREAMS)]

        def read(i: int) -> None:
            stream = coordinator.inference.Generate(
                greedy(PROMPTS[i], MAX_TOKENS, f"survivor-{i}"), timeout=TIMEOUT_SECONDS
            )
            for n, response in enumerate(stream):
                results[i].append(response)
                if n == 3:
                    started.wait()

        threads = [threading.Thread(target=read, args=(i,)) for i in range(STREAMS)]
        for thread in threads:
            thread.start()
        started.wait(TIMEOUT_SECONDS)
        doomed.kill()
        for thread in threads:
            thread.join(TIMEOUT_SECONDS)

        for responses, reference in zip(results, references, strict=True):
            assert assemble(responses) == reference
            assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert {r.worker_id for r in responses if r.token_ids} == {"doomed", "spare"}
            events = [r.event for r in responses if r.HasField("event")]
            assert [e.kind for e in events] == [common_pb2.EVENT_KIND_RECOVERED]
            assert events[0].from_worker == "doomed" and events[0].to_worker == "spare"
    finally:
        coordinator.stop()
