"""SLA classes in the engine: with vLLM's priority scheduling an INTERACTIVE request that
arrives while BATCH requests wait is scheduled before every one of them, and a request's own
priority orders it within its class; under first come first served it waits its turn.

The order is read from the engine itself: the first response of every stream carries vLLM's
own queued / scheduled timestamps of the request (`EngineTiming`, from its
`RequestStateStats`), on one engine clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from protos.spotinfer.v1 import common_pb2, worker_pb2
from spotinfer.local.worker_process import WorkerProcess
from tests.support.wait import wait_until

# Two running sequences at most, so that a handful of requests queue in vLLM itself.
FLAGS = ("--dtype", "float32", "--max-model-len", "1024", "--memory-gib", "0.25")
MAX_NUM_SEQS = 2
HOLD_TOKENS = 900  # the two holders keep both slots busy while the others queue
SHORT_TOKENS = 4
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


@dataclass(frozen=True)
class Scheduled:
    request_id: str
    sla_class: int
    queued_at: float
    scheduled_at: float


def _request(
    request_id: str, sla_class: int, max_tokens: int, priority: int | None = None
) -> common_pb2.GenerateRequest:
    message = common_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        sla_class=sla_class,  # type: ignore[arg-type]
    )
    if priority is not None:
        message.priority = priority
    return message


def _timing(worker: WorkerProcess, message: common_pb2.GenerateRequest) -> Scheduled:
    timing = None
    for response in worker.stub.Generate(message, timeout=300):
        if response.HasField("engine_timing") and timing is None:
            timing = response.engine_timing
    assert timing is not None, f"{message.request_id}: no response carried the engine's timing"
    return Scheduled(message.request_id, message.sla_class, timing.queued_at, timing.scheduled_at)


def _waiting(worker: WorkerProcess) -> int:
    return worker.stub.Stats(worker_pb2.StatsRequest(), timeout=10).waiting_seqs


def _running(worker: WorkerProcess) -> int:
    return worker.stub.Stats(worker_pb2.StatsRequest(), timeout=10).running_seqs


def _mixed_load(worker: WorkerProcess, tag: str, prioritized: bool) -> dict[str, Scheduled]:
    """Two long BATCH holders fill the engine; four short BATCH requests queue behind them
    (under priority scheduling two with priority 90, then two with priority 10); then two
    INTERACTIVE requests arrive. Returns every request's engine timing by id."""
    batch, interactive = common_pb2.SLA_CLASS_BATCH, common_pb2.SLA_CLASS_INTERACTIVE
    futures: list[Future[Scheduled]] = []
    with ThreadPoolExecutor(8) as pool:

        def send(message: common_pb2.GenerateRequest) -> None:
            futures.append(pool.submit(_timing, worker, message))

        for i in range(MAX_NUM_SEQS):
            send(_request(f"{tag}-hold-{i}", batch, HOLD_TOKENS))
        wait_until(lambda: _running(worker) == MAX_NUM_SEQS, "both holders running")
        for i, priority in enumerate((90, 90, 10, 10)):
            send(
                _request(f"{tag}-batch-{i}", batch, SHORT_TOKENS, priority if prioritized else None)
            )
            wait_until(lambda n=i + 1: _waiting(worker) >= n, f"batch request {i} queued")
        for i in range(2):
            send(_request(f"{tag}-interactive-{i}", interactive, SHORT_TOKENS))
            wait_until(lambda n=5 + i: _waiting(worker) >= n, f"interactive request {i} queued")
        assert _running(worker) == MAX_NUM_SEQS, "a holder ended before everything was queued"
        timings = [f.result(timeout=300) for f in futures]
    return {t.request_id: t for t in timings}


def _queued_before(timings: dict[str, Scheduled], request: Scheduled) -> list[Scheduled]:
    """The short BATCH requests that were already waiting when ``request`` was queued."""
    return [
        t
        for t in timings.values()
        if "-batch-" in t.request_id and t.queued_at < request.queued_at < t.scheduled_at
    ]


@pytest.fixture(scope="module")
def priority_worker(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    flags = (*FLAGS, "--max-num-seqs", str(MAX_NUM_SEQS))
    with WorkerProcess(tiny_model, *flags, log_dir=tmp_path_factory.mktemp("prio")) as worker:
        yield worker


def test_interactive_never_waits_behind_queued_batch(priority_worker: WorkerProcess) -> None:
    timings = _mixed_load(priority_worker, "prio", prioritized=True)
    interactive = [t for t in timings.values() if t.sla_class == common_pb2.SLA_CLASS_INTERACTIVE]
    for request in interactive:
        waiting = _queued_before(timings, request)
        assert len(waiting) == 4, f"{request.request_id}: every short batch request was waiting"
        late = [t.request_id for t in waiting if t.scheduled_at < request.scheduled_at]
        assert not late, f"{request.request_id} was scheduled after queued BATCH work {late}"
    # Within the class the request's own priority comes before arrival.
    low = [timings[f"prio-batch-{i}"].scheduled_at for i in (0, 1)]
    high = [timings[f"prio-batch-{i}"].scheduled_at for i in (2, 3)]
    assert max(high) <= min(low), "priority 10 must be scheduled before priority 90"


def test_priority_out_of_range_is_refused(priority_worker: WorkerProcess) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        _timing(priority_worker, _request("prio-bad", common_pb2.SLA_CLASS_BATCH, 4, 100))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "priority must be in 0..99" in (caught.value.details() or "")


def test_first_come_first_served_makes_interactive_wait(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The control: the same load under `--scheduling-policy fcfs` shows the waiting that
    priority scheduling removes (so the check above can tell the two apart), and a request
    that asks for a priority there is refused rather than quietly run in arrival order."""
    flags = (*FLAGS, "--max-num-seqs", str(MAX_NUM_SEQS), "--scheduling-policy", "fcfs")
    with WorkerProcess(tiny_model, *flags, log_dir=tmp_path_factory.mktemp("fcfs")) as worker:
        with pytest.raises(grpc.RpcError) as caught:
            _timing(worker, _request("fcfs-prio", common_pb2.SLA_CLASS_BATCH, 4, 10))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--scheduling-policy fcfs" in (caught.value.details() or "")
        timings = _mixed_load(worker, "fcfs", prioritized=False)
    for i in range(2):
        request = timings[f"fcfs-interactive-{i}"]
        waiting = _queued_before(timings, request)
        assert all(t.scheduled_at <= request.scheduled_at for t in waiting), (
            f"under fcfs {request.request_id} waits for the batch requests queued before it"
        )
        assert any(t.scheduled_at < request.scheduled_at for t in waiting)
