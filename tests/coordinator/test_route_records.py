"""With --redis-url, the coordinator keeps a record of each request in Redis (owner worker,
status, tokens delivered) — what a restarted coordinator will look up — and lets a finished
request's record expire after a short retention."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import grpc
import pytest
import redis

from protos.spotinfer.v1 import inference_pb2
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.worker_process import WorkerProcess
from store.keys import request_route_key, schema_pattern
from tests.coordinator.conftest import (
    TIMEOUT_SECONDS,
    assemble,
    greedy,
    health_of,
    start_coordinator,
)
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until


@pytest.fixture(scope="module")
def recording(
    workers: list[WorkerProcess],
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[CoordinatorProcess]:
    process = start_coordinator(
        "--worker",
        workers[1].address,
        "--redis-url",
        redis_server.url,
        "--coordinator-id",
        "c-test",
        log_dir=tmp_path_factory.mktemp("recording-logs"),
    )
    yield process
    process.stop()


def _record(redis_server: RedisServer, request_id: str) -> dict[str, str]:
    client = redis.Redis(host=redis_server.host, port=redis_server.port)
    try:
        fields: dict[bytes, bytes] = client.hgetall(request_route_key(request_id))  # type: ignore[assignment]
        return {k.decode(): v.decode() for k, v in fields.items()}
    finally:
        client.close()


def test_finished_request_is_recorded(
    recording: CoordinatorProcess, redis_server: RedisServer
) -> None:
    responses = list(
        recording.inference.Generate(greedy([5, 17, 42], 9, "recorded"), timeout=TIMEOUT_SECONDS)
    )
    assert len(assemble(responses)) == 9
    # Records are written behind the stream.
    wait_until(
        lambda: _record(redis_server, "recorded").get("status") == "finished",
        "the record finished",
        10,
        0.1,
    )
    record = _record(redis_server, "recorded")
    assert record["finish_reason"] == "LENGTH"
    assert record["delivered_length"] == "9"
    assert record["owner_worker_id"] == "w1"
    assert record["coordinator_id"] == "c-test"
    assert record["sla_class"] == "INTERACTIVE"


@pytest.fixture(scope="module")
def forgetting(
    workers: list[WorkerProcess],
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[CoordinatorProcess]:
    """A coordinator that keeps a finished request's record for one second only."""
    process = start_coordinator(
        "--worker",
        workers[1].address,
        "--redis-url",
        redis_server.url,
        "--record-retention-seconds",
        "1",
        log_dir=tmp_path_factory.mktemp("forgetting-logs"),
    )
    yield process
    process.stop()


def _keys_of(redis_server: RedisServer, request_ids: list[str]) -> list[str]:
    """Every key of the store's schema that belongs to one of ``request_ids``."""
    client = redis.Redis(host=redis_server.host, port=redis_server.port)
    try:
        keys = [k.decode() for k in client.scan_iter(match=schema_pattern(), count=1000)]
    finally:
        client.close()
    tags = {"{" + request_id + "}" for request_id in request_ids}
    return [key for key in keys if any(tag in key for tag in tags)]


def test_nothing_of_a_finished_request_stays_in_redis(
    forgetting: CoordinatorProcess, redis_server: RedisServer
) -> None:
    request_ids = [f"forgotten-{i}" for i in range(3)]
    for request_id in request_ids:
        responses = list(
            forgetting.inference.Generate(
                greedy([5, 17, 42], 6, request_id), timeout=TIMEOUT_SECONDS
            )
        )
        assert len(assemble(responses)) == 6
        # The record is written (behind the stream) and is there for about the retention.
        wait_until(partial(_record, redis_server, request_id), f"a record of {request_id}", 10)
    wait_until(
        lambda: not _keys_of(redis_server, request_ids),
        "no key left in Redis after the retention",
        30,
        0.1,
    )


def test_attach_while_redis_is_down_answers_unavailable(tmp_path: Path) -> None:
    """A client that re-attaches while the coordinator cannot reach Redis learns it should
    try again (UNAVAILABLE, with the reason), not that the server failed (INTERNAL)."""
    with RedisServer() as redis_server:
        coordinator = start_coordinator(
            "--redis-url", redis_server.url, log_dir=tmp_path, wait_serving=False
        )
        try:
            wait_until(lambda: _answers(coordinator), "the coordinator to answer", 60)
            redis_server.stop()
            with pytest.raises(grpc.RpcError) as raised:
                list(
                    coordinator.inference.Attach(
                        inference_pb2.AttachRequest(request_id="during-outage", from_index=3),
                        timeout=TIMEOUT_SECONDS,
                    )
                )
        finally:
            coordinator.stop()
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, raised.value.details()
    assert "Redis unavailable" in (raised.value.details() or "")


def _answers(coordinator: CoordinatorProcess) -> bool:
    try:
        health_of(coordinator)
    except grpc.RpcError:
        return False
    return True
