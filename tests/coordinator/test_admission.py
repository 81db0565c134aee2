"""Admission with tiny queues and caps: a full queue is RESOURCE_EXHAUSTED with a retry hint,
INTERACTIVE is served before BATCH, and a queued request leaves its queue when cancelled or
when its client goes away (hangs up, or its deadline passes)."""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from protos.spotinfer.v1 import common_pb2, inference_pb2
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.worker_process import WorkerProcess
from tests.coordinator.conftest import TIMEOUT_SECONDS, assemble, greedy, start_coordinator
from tests.support.wait import wait_until

PROMPT_IDS = [5, 17, 42, 99]
LONG = 900  # tokens: long enough to hold its slot while the test queues others


def _one_worker_coordinator(
    worker: WorkerProcess, log_dir: Path, *flags: str
) -> Iterator[CoordinatorProcess]:
    """A coordinator in front of ``worker`` with one place in each queue, and ``flags``."""
    process = start_coordinator(
        *("--worker", worker.address),
        *("--interactive-queue-capacity", "1", "--batch-queue-capacity", "1"),
        *flags,
        log_dir=log_dir,
    )
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def tight(
    workers: list[WorkerProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CoordinatorProcess]:
    """One worker, one slot on it, one place in each queue."""
    yield from _one_worker_coordinator(
        workers[0],
        tmp_path_factory.mktemp("tight-logs"),
        *("--max-seqs-per-worker", "1", "--retry-after-ms", "250"),
    )


def _cancel(process: CoordinatorProcess, request_id: str) -> None:
    process.inference.Cancel(inference_pb2.CancelRequest(request_id=request_id), timeout=30)


def _queue_depth(process: CoordinatorProcess, sla: int) -> int:
    from protos.spotinfer.v1 import control_pb2

    status = process.control.ClusterStatus(control_pb2.ClusterStatusRequest(), timeout=10)
    return next(q.depth for q in status.queues if q.sla_class == sla)


def test_full_queue_is_resource_exhausted_with_a_retry_hint(tight: CoordinatorProcess) -> None:
    running = tight.inference.Generate(greedy(PROMPT_IDS, LONG, "holds-slot"), timeout=120)
    next(running)  # it holds the only slot now
    waiting = tight.inference.Generate(greedy(PROMPT_IDS, 4, "waits"), timeout=120)
    waiter = threading.Thread(target=lambda: list(waiting))
    waiter.start()
    try:
        while _queue_depth(tight, common_pb2.SLA_CLASS_INTERACTIVE) < 1:
            pass
        with pytest.raises(grpc.RpcError) as refused:
            list(tight.inference.Generate(greedy(PROMPT_IDS, 4, "refused"), timeout=30))
        error = refused.value
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        hint = dict(error.trailing_metadata() or ())["retry-after-ms"]
        assert int(hint) >= 250
        assert f"retry after {hint} ms" in error.details()

        over_http = urllib.request.Request(
            tight.http_url + "/v1/completions",
            data=json.dumps({"prompt": PROMPT_IDS, "max_tokens": 4}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as too_many:
            urllib.request.urlopen(over_http, timeout=30)
        assert too_many.value.code == 429
        assert int(too_many.value.headers["Retry-After"]) >= 1
        assert int(too_many.value.headers["retry-after-ms"]) >= 250
    finally:
        _cancel(tight, "holds-slot")
        waiter.join(TIMEOUT_SECONDS)
        running.cancel()
    # The queued request ran once the slot was free.
    assert assemble(list(tight.inference.Attach(inference_pb2.AttachRequest(request_id="waits"))))


def test_interactive_is_served_before_batch(tight: CoordinatorProcess) -> None:
    order: list[str] = []
    lock = threading.Lock()

    def run(request: common_pb2.GenerateRequest) -> None:
        for response in tight.inference.Generate(request, timeout=TIMEOUT_SECONDS):
            if response.token_ids:
                with lock:
                    order.append(request.request_id)
                return

    blocker = tight.inference.Generate(greedy(PROMPT_IDS, LONG, "blocker"), timeout=120)
    next(blocker)
    batch = threading.Thread(
        target=run,
        args=(greedy(PROMPT_IDS, 4, "batch-1", sla_class=common_pb2.SLA_CLASS_BATCH),),
    )
    batch.start()
    while _queue_depth(tight, common_pb2.SLA_CLASS_BATCH) < 1:
        pass
    interactive = threading.Thread(target=run, args=(greedy(PROMPT_IDS, 4, "interactive-1"),))
    interactive.start()
    while _queue_depth(tight, common_pb2.SLA_CLASS_INTERACTIVE) < 1:
        pass
    _cancel(tight, "blocker")
    blocker.cancel()
    for thread in (batch, interactive):
        thread.join(TIMEOUT_SECONDS)
    assert order == ["interactive-1", "batch-1"]


def test_cancelled_queued_request_leaves_the_queue(tight: CoordinatorProcess) -> None:
    holder = tight.inference.Generate(greedy(PROMPT_IDS, LONG, "holder"), timeout=120)
    next(holder)
    queued = tight.inference.Generate(greedy(PROMPT_IDS, 4, "queued"), timeout=120)
    responses: list[common_pb2.GenerateResponse] = []
    reader = threading.Thread(target=lambda: responses.extend(queued))
    reader.start()
    while _queue_depth(tight, common_pb2.SLA_CLASS_INTERACTIVE) < 1:
        pass
    _cancel(tight, "queued")
    reader.join(TIMEOUT_SECONDS)
    assert _queue_depth(tight, common_pb2.SLA_CLASS_INTERACTIVE) == 0
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert not list(itertools.chain.from_iterable(r.token_ids for r in responses))
    _cancel(tight, "holder")
    holder.cancel()


def _wait_queue_depth(process: CoordinatorProcess, depth: int) -> None:
    wait_until(
        lambda: _queue_depth(process, common_pb2.SLA_CLASS_INTERACTIVE) == depth,
        f"the queue holding {depth}",
        TIMEOUT_SECONDS,
    )


def _attach_all(process: CoordinatorProcess, request_id: str) -> list[common_pb2.GenerateResponse]:
    attach = inference_pb2.AttachRequest(request_id=request_id)
    return list(process.inference.Attach(attach, timeout=TIMEOUT_SECONDS))


@pytest.mark.parametrize("how", ["deadline", "hang-up", "http-hang-up"])
def test_queued_request_whose_client_went_away_never_runs(
    tight: CoordinatorProcess, how: str
) -> None:
    holder = tight.inference.Generate(greedy(PROMPT_IDS, LONG, f"holder-{how}"), timeout=120)
    next(holder)
    request_id = f"left-{how}"
    try:
        if how == "deadline":
            with pytest.raises(grpc.RpcError) as expired:
                # Well inside the holder's run: the tiny model decodes its LONG tokens in about
                # a second on a quiet machine, and a longer deadline raced the slot coming free.
                list(tight.inference.Generate(greedy(PROMPT_IDS, 4, request_id), timeout=0.3))
            assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        elif how == "hang-up":
            call = tight.inference.Generate(greedy(PROMPT_IDS, 4, request_id), timeout=120)
            _wait_queue_depth(tight, 1)
            call.cancel()
        else:
            host, port = tight.http_url.removeprefix("http://").split(":")
            connection = http.client.HTTPConnection(host, int(port), timeout=30)
            body = {"prompt": PROMPT_IDS, "max_tokens": 4, "stream": True, "request_id": request_id}
            connection.request(
                "POST",
                "/v1/completions",
                body=json.dumps(body),
                headers={"Content-Type": "application/json"},
            )
            _wait_queue_depth(tight, 1)
            connection.close()
        _wait_queue_depth(tight, 0)
    finally:
        _cancel(tight, f"holder-{how}")
        holder.cancel()
    # The slot is free now: had it stayed in the queue, it would run here.
    responses = _attach_all(tight, request_id)
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert not list(itertools.chain.from_iterable(r.token_ids for r in responses))


@pytest.fixture(scope="module")
def capped(
    workers: list[WorkerProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CoordinatorProcess]:
    """One worker, two slots on it: at most one for each SLA class."""
    yield from _one_worker_coordinator(
        workers[0],
        tmp_path_factory.mktemp("capped-logs"),
        *("--max-seqs-per-worker", "2"),
        *("--interactive-max-per-worker", "1", "--batch-max-per-worker", "1"),
    )


def test_batch_takes_a_slot_waiting_interactive_requests_cannot_use(
    capped: CoordinatorProcess,
) -> None:
    """INTERACTIVE waits on its own class cap; the BATCH slot beside it must not idle."""
    holder = capped.inference.Generate(greedy(PROMPT_IDS, LONG, "capped-holder"), timeout=120)
    next(holder)
    waiting = capped.inference.Generate(greedy(PROMPT_IDS, 4, "capped-waits"), timeout=120)
    waiter = threading.Thread(target=lambda: list(waiting))
    waiter.start()
    try:
        _wait_queue_depth(capped, 1)
        batch = greedy(PROMPT_IDS, 4, "capped-batch", sla_class=common_pb2.SLA_CLASS_BATCH)
        # It runs and finishes while the interactive one still waits for its class's slot.
        assert len(assemble(list(capped.inference.Generate(batch, timeout=60)))) == 4
        assert _queue_depth(capped, common_pb2.SLA_CLASS_INTERACTIVE) == 1
        assert _queue_depth(capped, common_pb2.SLA_CLASS_BATCH) == 0
    finally:
        _cancel(capped, "capped-holder")
        holder.cancel()
        waiter.join(TIMEOUT_SECONDS)
    assert len(assemble(_attach_all(capped, "capped-waits"))) == 4
