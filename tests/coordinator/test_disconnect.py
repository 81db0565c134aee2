"""Clients that leave: a running request whose every client left (an HTTP hang-up, streamed
or not; a cancelled gRPC call) is cancelled on its worker once the disconnect grace passes
with nobody back, and its keys are deleted; a client that re-attaches within the grace gets
the whole stream exactly once; a BATCH request runs to its end without a reader.

One worker that persists to the package's Redis, behind a coordinator of this module whose
grace is short (GRACE_SECONDS); the requests are long (the tiny model decodes 900 tokens in
seconds), so each is still running when its grace runs out.
"""

from __future__ import annotations

import itertools
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from protos.spotinfer.v1 import common_pb2, inference_pb2, worker_pb2
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.worker_process import WorkerProcess
from store.redis_store import RedisStore
from tests.coordinator.conftest import (
    TIMEOUT_SECONDS,
    WORKER_FLAGS,
    assemble,
    greedy,
    start_coordinator,
)
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until

GRACE_SECONDS = 1.0
LONG = 900  # tokens: seconds of decoding, well past the grace
PROMPT_IDS = [11, 42, 7, 301, 95, 18, 260]
CANCELS = "spotinfer_coordinator_disconnect_cancels_total"
IN_FLIGHT = "spotinfer_coordinator_requests_in_flight"


@pytest.fixture(scope="module")
def worker(
    tiny_model: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    with WorkerProcess(
        tiny_model,
        *WORKER_FLAGS,
        *("--redis-url", redis_server.url, "--worker-id", "leaver"),
        log_dir=tmp_path_factory.mktemp("disconnect-worker"),
    ) as process:
        yield process


@pytest.fixture(scope="module")
def coordinator(
    worker: WorkerProcess, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CoordinatorProcess]:
    process = start_coordinator(
        *("--worker", worker.address, "--model", str(tiny_model)),
        *("--disconnect-grace-seconds", str(GRACE_SECONDS)),
        log_dir=tmp_path_factory.mktemp("disconnect-coordinator"),
    )
    try:
        yield process
    finally:
        process.stop()


def _metric(coordinator: CoordinatorProcess, name: str) -> float:
    with urllib.request.urlopen(coordinator.http_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def _record_of(store: RedisStore, request_id: str) -> str:
    try:
        record = store.get_request(request_id)
    except Exception as exc:  # gone, or unreadable: either is worth seeing
        return f"({exc.__class__.__name__})"
    return f"{record.status.name} by {record.owner_worker_id}"


def _running_on(worker: WorkerProcess) -> int:
    return int(worker.stub.Stats(worker_pb2.StatsRequest(), timeout=10).running_seqs)


def _assert_cancelled_and_gone(
    coordinator: CoordinatorProcess,
    worker: WorkerProcess,
    store: RedisStore,
    request_id: str,
    cancels_before: float,
) -> None:
    """Nothing runs any more — not in the coordinator, not on the worker — the request was
    cancelled for its missing client, and the store holds none of its keys."""

    def state() -> str:
        return (
            f"in flight {_metric(coordinator, IN_FLIGHT)}, running on the worker "
            f"{_running_on(worker)}, cancels {_metric(coordinator, CANCELS) - cancels_before}, "
            f"keys {store.keys_for_request(request_id)}, record {_record_of(store, request_id)}, "
            f"TTLs {store.request_ttl_seconds(request_id)}"
        )

    wait_until(
        lambda: _metric(coordinator, IN_FLIGHT) == 0 and _running_on(worker) == 0,
        lambda: f"{request_id} still running after its client left: {state()}",
        timeout=GRACE_SECONDS + 60,
        interval=0.2,
    )
    assert _metric(coordinator, CANCELS) - cancels_before == 1, state()
    wait_until(
        lambda: store.keys_for_request(request_id) == [],
        lambda: f"{request_id}'s keys stayed: {state()}",
        timeout=30,
        interval=0.2,
    )
    ended = list(
        coordinator.inference.Attach(
            inference_pb2.AttachRequest(request_id=request_id), timeout=TIMEOUT_SECONDS
        )
    )
    assert ended[-1].finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert len(assemble(ended)) < LONG


def _wait_for_keys(store: RedisStore, request_id: str) -> None:
    """The worker has persisted the running request (so that "its keys are gone" means
    something)."""
    wait_until(lambda: store.keys_for_request(request_id), f"{request_id} in Redis", timeout=60)


def _completion(request_id: str, stream: bool) -> dict[str, object]:
    return {
        "prompt": PROMPT_IDS,
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "request_id": request_id,
    }


def test_a_streamed_http_client_that_hangs_up_stops_its_request(
    coordinator: CoordinatorProcess, worker: WorkerProcess, store: RedisStore
) -> None:
    request_id = "http-streamed-leaver"
    before = _metric(coordinator, CANCELS)
    response = requests.post(
        coordinator.http_url + "/v1/completions",
        json=_completion(request_id, stream=True),
        stream=True,
        timeout=TIMEOUT_SECONDS,
    )
    assert response.status_code == 200, response.text
    events = response.iter_lines()
    head = [line for line in itertools.islice(events, 6) if line.startswith(b"data: ")]
    assert head and "choices" in json.loads(head[-1][len(b"data: ") :])
    _wait_for_keys(store, request_id)
    response.close()  # the client hangs up mid-stream
    _assert_cancelled_and_gone(coordinator, worker, store, request_id, before)


def test_an_http_client_that_gives_up_on_a_whole_answer_stops_its_request(
    coordinator: CoordinatorProcess, worker: WorkerProcess, store: RedisStore
) -> None:
    request_id = "http-whole-leaver"
    before = _metric(coordinator, CANCELS)
    with pytest.raises(requests.exceptions.ReadTimeout):
        # The client's own timeout: it closes the connection before the answer is ready.
        requests.post(
            coordinator.http_url + "/v1/completions",
            json=_completion(request_id, stream=False),
            timeout=(10, 0.5),
        )
    _assert_cancelled_and_gone(coordinator, worker, store, request_id, before)


def test_a_cancelled_grpc_call_stops_its_request(
    coordinator: CoordinatorProcess, worker: WorkerProcess, store: RedisStore
) -> None:
    request_id = "grpc-leaver"
    before = _metric(coordinator, CANCELS)
    call = coordinator.inference.Generate(
        greedy(PROMPT_IDS, LONG, request_id=request_id), timeout=TIMEOUT_SECONDS
    )
    assert assemble(list(itertools.islice(call, 2)))
    _wait_for_keys(store, request_id)
    call.cancel()
    _assert_cancelled_and_gone(coordinator, worker, store, request_id, before)


def test_a_client_back_within_the_grace_gets_the_whole_stream_once(
    coordinator: CoordinatorProcess,
) -> None:
    request_id = "grpc-returner"
    before = _metric(coordinator, CANCELS)
    call = coordinator.inference.Generate(
        greedy(PROMPT_IDS, LONG, request_id=request_id), timeout=TIMEOUT_SECONDS
    )
    head = list(itertools.islice(call, 3))
    call.cancel()  # a dropped connection; the client's retry attaches at once
    seen = len(assemble(head))
    rest = list(
        coordinator.inference.Attach(
            inference_pb2.AttachRequest(request_id=request_id, from_index=seen),
            timeout=TIMEOUT_SECONDS,
        )
    )
    tokens = assemble(head + rest)  # every index once, in order, across the re-attach
    assert len(tokens) == LONG and rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert _metric(coordinator, CANCELS) == before


def test_a_batch_request_runs_to_its_end_without_a_reader(
    coordinator: CoordinatorProcess, worker: WorkerProcess
) -> None:
    request_id = "batch-without-reader"
    request = greedy(PROMPT_IDS, LONG, request_id=request_id)
    request.sla_class = common_pb2.SLA_CLASS_BATCH
    before = _metric(coordinator, CANCELS)
    call = coordinator.inference.Generate(request, timeout=TIMEOUT_SECONDS)
    assert assemble(list(itertools.islice(call, 2)))
    call.cancel()
    wait_until(
        lambda: _metric(coordinator, IN_FLIGHT) == 0 and _running_on(worker) == 0,
        f"{request_id} to end",
        timeout=120,
        interval=0.2,
    )
    whole = list(
        coordinator.inference.Attach(
            inference_pb2.AttachRequest(request_id=request_id), timeout=TIMEOUT_SECONDS
        )
    )
    assert len(assemble(whole)) == LONG
    assert whole[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert _metric(coordinator, CANCELS) == before


def test_a_negative_or_nan_grace_is_refused(tmp_path: Path) -> None:
    for bad in ("-1", "nan"):
        process = CoordinatorProcess(
            "--failover-policy", "fail", "--disconnect-grace-seconds", bad, log_dir=tmp_path
        )
        try:
            with pytest.raises(RuntimeError, match="disconnect_grace_seconds"):
                process.start()
        finally:
            process.stop()
