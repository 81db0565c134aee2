"""Sampled streams across a loss: the resume continues from what the client received, and a
seeded request continues its random sequence.

Real processes: the package's redis-server, worker A (a fresh process per test, killed or
noticed) and the package's standby B. Sampling at temperature 1 on the tiny random-weight
model picks a different token almost every time the history or the random draw differs, so
a continuation from another history, or a restarted seed, shows at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from protos.spotinfer.v1 import common_pb2, worker_pb2
from spotinfer.local.worker_process import WorkerProcess
from store import RedisStore
from tests.resume.conftest import BLOCK_TOKENS, worker_flags
from tests.resume.streams import (
    STREAM_TIMEOUT_SECONDS,
    StreamReader,
    assemble,
    generate,
    recovery_event,
)
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until

PROMPT = list(range(60, 100))
MAX_TOKENS = 700
# Past the first stored chunk: a loss from here on loads stored KV and recomputes the rest.
PAST_FIRST_CHUNK = BLOCK_TOKENS - len(PROMPT) + 40
# Tokens the client receives while Redis cannot take them, before the worker dies.
UNCONFIRMED_TOKENS = 40
SEED = 1234


def sampled_request(
    request_id: str, max_tokens: int = MAX_TOKENS, seed: int | None = None
) -> common_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
    if seed is not None:
        sampling.seed = seed
    return common_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=PROMPT, sampling=sampling
    )


@contextlib.contextmanager
def redis_stopped(server: RedisServer) -> Iterator[None]:
    """redis-server frozen (SIGSTOP): connections stay open, nothing is answered."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


@pytest.fixture
def worker_a(
    tiny_model: Path, redis_server: RedisServer, tmp_path: Path
) -> Iterator[WorkerProcess]:
    with WorkerProcess(
        tiny_model, *worker_flags(redis_server.url), "--worker-id", "worker-a", log_dir=tmp_path
    ) as process:
        # Lowered (its whole process group): on a loaded machine the test's thread, which
        # watches the stream and acts, gets the CPU first, and A cannot run to its end first.
        assert process.pid is not None
        os.setpriority(os.PRIO_PGRP, process.pid, 10)
        yield process


def start(worker: WorkerProcess, request: common_pb2.GenerateRequest) -> StreamReader:
    reader = StreamReader(worker.stub.Generate(request, timeout=STREAM_TIMEOUT_SECONDS))
    wait_until(
        lambda: reader.done or len(reader.tokens()) >= PAST_FIRST_CHUNK,
        f"{request.request_id} past its first KV chunk",
    )
    assert not reader.done, f"the stream ended early: {reader.error}"
    return reader


def kill(worker: WorkerProcess, reader: StreamReader) -> list[int]:
    worker.kill()
    reader.join()
    assert reader.error is not None, "the stream of the killed worker must break"
    assert not [r for r in reader.responses if r.finish_reason], "it ended before the kill"
    return reader.tokens()


def resume(
    standby: WorkerProcess, request_id: str, received: list[int]
) -> tuple[common_pb2.Event, list[int]]:
    """Worker.Resume as the coordinator calls it: from the client's count, with its tokens."""
    responses = list(
        standby.stub.Resume(
            worker_pb2.ResumeRequest(
                request_id=request_id, from_index=len(received), delivered_token_ids=received
            ),
            timeout=STREAM_TIMEOUT_SECONDS,
        )
    )
    return recovery_event(responses, len(received)), assemble(responses, len(received))


def test_a_sampled_stream_continues_from_the_tokens_its_client_received(
    worker_a: WorkerProcess,
    redis_server: RedisServer,
    store: RedisStore,
    standby: WorkerProcess,
) -> None:
    """Redis stalls, A streams on (a token reaches the client before Redis confirms it), then
    A dies: the store holds fewer tokens than the client. B's context must be prompt + the
    client's tokens, so the record B leaves is exactly the stream the client read."""
    request_id = "continuation-sampled"
    reader = start(worker_a, sampled_request(request_id))
    with redis_stopped(redis_server):
        before = len(reader.tokens())
        wait_until(
            lambda: reader.done or len(reader.tokens()) >= before + UNCONFIRMED_TOKENS,
            "tokens the client has and Redis does not",
        )
        received = kill(worker_a, reader)
    stored = store.committed_tokens(request_id)
    assert len(stored) < len(received), "the store lags the client: the test proves something"
    assert stored == received[: len(stored)]

    event, resumed = resume(standby, request_id, received)

    assert event.kind == common_pb2.EVENT_KIND_RECOVERED
    assert (
        f"continued from the {len(received)} tokens its client received "
        f"(the store held {len(stored)})" in event.detail
    )
    output = received + resumed
    assert len(output) == MAX_TOKENS, "every index once"
    # The worker's record: the client's tokens, then B's, each once and in order.
    wait_until(
        lambda: store.committed_tokens(request_id) == output,
        "the record holds the stream the client read",
    )
    store.release_request(request_id)


def test_a_seeded_stream_after_an_abrupt_loss_equals_the_uninterrupted_run(
    worker_a: WorkerProcess, store: RedisStore, standby: WorkerProcess
) -> None:
    request_id = "continuation-seeded-loss"
    received = kill(worker_a, start(worker_a, sampled_request(request_id, seed=SEED)))

    event, resumed = resume(standby, request_id, received)

    assert event.kind == common_pb2.EVENT_KIND_RECOVERED
    reference = generate(standby, sampled_request("continuation-seeded-ref-1", seed=SEED))
    assert received + resumed == reference
    store.release_request(request_id)


def test_a_seeded_stream_after_a_migration_equals_the_uninterrupted_run(
    worker_a: WorkerProcess, store: RedisStore, standby: WorkerProcess
) -> None:
    request_id = "continuation-seeded-notice"
    reader = start(worker_a, sampled_request(request_id, seed=SEED))
    reports = list(
        worker_a.stub.Preempt(worker_pb2.PreemptRequest(deadline_unix=time.time() + 30), timeout=60)
    )
    reader.join()
    assert [r.request_id for r in reports] == [request_id] and reports[0].complete
    assert reader.responses[-1].event.kind == common_pb2.EVENT_KIND_NOTICE
    received = reader.tokens()

    event, resumed = resume(standby, request_id, received)

    assert event.kind == common_pb2.EVENT_KIND_MIGRATED and event.recomputed_tokens == 0
    reference = generate(standby, sampled_request("continuation-seeded-ref-2", seed=SEED))
    assert received + resumed == reference
    store.release_request(request_id)


def test_delivered_tokens_that_do_not_match_the_count_are_refused(
    standby: WorkerProcess,
) -> None:
    import grpc

    with pytest.raises(grpc.RpcError) as error:
        list(
            standby.stub.Resume(
                worker_pb2.ResumeRequest(
                    request_id="continuation-bad", from_index=3, delivered_token_ids=[1, 2]
                ),
                timeout=30,
            )
        )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "delivered_token_ids holds 2 tokens but from_index is 3" in (error.value.details() or "")
