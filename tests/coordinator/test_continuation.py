"""An abrupt loss under sampling, through the coordinator: the resume continues from the
tokens the client received, not from the store's shorter copy.

A coordinator (`--failover-policy resume`) in front of two workers persisting to a Redis of
this module. A sampled stream (temperature 1, no seed) runs past its first KV chunk; Redis
then freezes (SIGSTOP) while the worker streams on, so the client holds tokens Redis never
confirmed; the worker is SIGKILLed and Redis thaws. The coordinator resumes the request on
the spare worker: the record that worker leaves must be exactly the stream the client read
(prompt + received tokens was its context), and the stream exactly once.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from protos.spotinfer.v1 import common_pb2
from spotinfer.local.worker_process import WorkerProcess
from store import RedisStore
from tests.coordinator.conftest import start_coordinator, started_workers
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until

PROMPT = list(range(60, 100))
MAX_TOKENS = 700
PAST_FIRST_CHUNK = 256 - len(PROMPT) + 40  # output tokens: the first stored chunk is full
UNCONFIRMED_TOKENS = 40  # what the client receives while Redis is frozen
TIMEOUT_SECONDS = 300


@pytest.fixture(scope="module")
def frozen_redis() -> Iterator[RedisServer]:
    """This module's own redis-server: the test freezes it."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def pair(
    tiny_model: Path, frozen_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[WorkerProcess]]:
    log_dir = tmp_path_factory.mktemp("continuation-logs")
    names = ["sampled-doomed", "sampled-spare"]
    with started_workers(tiny_model, names, log_dir, "--redis-url", frozen_redis.url) as pair:
        yield pair


def test_a_sampled_stream_resumes_from_what_its_client_received(
    pair: list[WorkerProcess], frozen_redis: RedisServer, tmp_path: Path
) -> None:
    doomed, spare = pair
    coordinator = start_coordinator(
        *("--worker", doomed.address, "--standby", spare.address),
        *("--failover-policy", "resume", "--lost-after-seconds", "2"),
        log_dir=tmp_path,
    )
    request_id = "coordinator-sampled-loss"
    received: list[common_pb2.GenerateResponse] = []
    lock = threading.Lock()

    def tokens() -> int:
        with lock:
            return sum(len(r.token_ids) for r in received)

    def read() -> None:
        request = common_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=PROMPT,
            sampling=common_pb2.SamplingParams(
                max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True
            ),
        )
        for response in coordinator.inference.Generate(request, timeout=TIMEOUT_SECONDS):
            with lock:
                received.append(response)

    reader = threading.Thread(target=read, daemon=True)
    store = RedisStore.from_url(frozen_redis.url)
    try:
        reader.start()
        wait_until(lambda: tokens() >= PAST_FIRST_CHUNK, "the stream past its first KV chunk")
        assert frozen_redis.pid is not None
        os.kill(frozen_redis.pid, signal.SIGSTOP)
        try:
            before = tokens()
            wait_until(
                lambda: tokens() >= before + UNCONFIRMED_TOKENS,
                "tokens the client has and Redis does not",
            )
            doomed.kill()
            at_kill = tokens()
        finally:
            os.kill(frozen_redis.pid, signal.SIGCONT)
        stored_at_kill = len(store.committed_tokens(request_id))
        assert stored_at_kill < at_kill, "the store lags the client: the test proves something"
        reader.join(TIMEOUT_SECONDS)
        assert not reader.is_alive(), "the stream ended"

        output: list[int] = []
        for response in received:
            if response.token_ids:
                assert response.index == len(output), "exactly once, in order"
                output.extend(response.token_ids)
        assert len(output) == MAX_TOKENS
        assert received[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        events = [r.event for r in received if r.HasField("event")]
        assert [e.kind for e in events] == [common_pb2.EVENT_KIND_RECOVERED]
        assert "tokens its client received" in events[0].detail
        # The spare worker's record: the client's tokens, then its own, once each.
        wait_until(
            lambda: store.committed_tokens(request_id) == output,
            "the record holds the stream the client read",
        )
    finally:
        store.close()
        coordinator.stop()
