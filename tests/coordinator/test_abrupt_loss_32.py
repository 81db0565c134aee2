"""Acceptance: SIGKILL of a worker with no notice. 32 concurrent greedy streams go through a
coordinator (`--failover-policy resume`) to one worker that persists to Redis; 24 run there,
8 wait in the coordinator's queue. Once the running ones are past their first full KV block,
the worker is SIGKILLed. Every stream must still complete, exactly once, equal to an
uninterrupted run; each interrupted one carries one RECOVERED event whose recompute is
bounded by the tokens after the last persisted block; the queued ones run on the survivor.
Afterwards nothing of these requests is left in Redis.

The kill point is chosen by a process of its own watching the store
(tests/support/freeze_and_kill.py), not by this test's threads: they read 32 streams and can
lose the GIL for seconds on a loaded machine, while the tiny model decodes a few hundred
tokens a second, so a kill they time can come after a block boundary whose eager save is
still in the writer's queue, or after the streams ended.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import redis

from protos.spotinfer.v1 import common_pb2
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.worker_process import REPO_ROOT, WorkerProcess, process_environment
from store.keys import schema_pattern
from tests.coordinator.conftest import greedy, start_coordinator
from tests.coordinator.streams import offline_reference
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until
from worker.constants import DEFAULT_KV_CHUNK_TOKENS

STREAMS = 32
RUNNING_SLOTS = 24  # the coordinator lets 24 run on the worker and queues the other 8
PROMPT_TOKENS = 40
# 40 + 900 tokens: three full 256-token chunks by the end, and a few seconds between the kill
# point and the end even on a loaded machine (the tiny model decodes ~200 tokens a second).
MAX_TOKENS = 900
BLOCK_TOKENS = DEFAULT_KV_CHUNK_TOKENS  # the store's unit: one stored chunk
# Kill once the running streams have this many tokens committed: their first chunk is full (at
# 216 output tokens) and persisted by then.
KILL_AFTER_TOKENS = BLOCK_TOKENS - PROMPT_TOKENS + 42
MAX_MODEL_LEN = 1024
STREAM_TIMEOUT_SECONDS = 900
WAIT_SECONDS = 600
RECORD_RETENTION_SECONDS = 1


def _prompts() -> list[list[int]]:
    """32 distinct 40-token prompts of ordinary (non-special) token ids."""
    return [[10 + (7 * i + 13 * j) % 480 for j in range(PROMPT_TOKENS)] for i in range(STREAMS)]


def _worker_flags(redis_url: str) -> tuple[str, ...]:
    return (
        *("--dtype", "float32"),  # outputs are compared token for token
        *("--max-model-len", str(MAX_MODEL_LEN)),
        *("--memory-gib", "0.25"),  # ~2,000 blocks of this model: all 32 fit at once
        *("--redis-url", redis_url),
        *("--kv-persist-policy", "eager"),
    )


@dataclass
class StreamTrace:
    """What one client saw, counted rather than trusted (exactly-once check)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    token_workers: list[str] = field(default_factory=list)
    events: list[common_pb2.Event] = field(default_factory=list)
    duplicates: int = 0
    gaps: int = 0
    finish_reason: int = 0
    error: grpc.RpcError | None = None

    def record(self, response: common_pb2.GenerateResponse) -> None:
        if response.HasField("event"):
            self.events.append(response.event)
        for offset, token in enumerate(response.token_ids):
            index = response.index + offset
            if index < len(self.token_ids):
                self.duplicates += 1
                continue
            self.gaps += index - len(self.token_ids)
            self.token_ids.append(token)
            self.token_workers.append(response.worker_id)
        if response.finish_reason:
            self.finish_reason = response.finish_reason


@pytest.fixture(scope="module")
def doomed_and_spare(
    tiny_model: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[WorkerProcess]]:
    log_dir = tmp_path_factory.mktemp("abrupt-loss-32-logs")
    processes = [
        WorkerProcess(
            tiny_model, *_worker_flags(redis_server.url), "--worker-id", name, log_dir=log_dir
        )
        for name in ("doomed", "spare")
    ]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: p.start(), processes))
        yield processes
    finally:
        for process in processes:
            if process.process is not None:
                process.stop()


def _killer(
    redis_server: RedisServer, doomed: WorkerProcess, request_ids: list[str], tmp_path: Path
) -> subprocess.Popen[str]:
    """Starts the process that SIGKILLs ``doomed`` once RUNNING_SLOTS requests are live there
    with KILL_AFTER_TOKENS committed and each full block of their context linked; returns
    once it watches (start the streams after: on a loaded machine a process started while
    they run may only get going when they are nearly done)."""
    assert doomed.process is not None
    ids_path = tmp_path / "request-ids.json"
    ids_path.write_text(json.dumps(request_ids))
    killer = subprocess.Popen(
        [
            sys.executable,
            *("-m", "tests.support.freeze_and_kill"),
            redis_server.url,
            str(doomed.process.pid),
            str(tmp_path / "frozen.json"),
            str(ids_path),
            *(str(n) for n in (RUNNING_SLOTS, KILL_AFTER_TOKENS, MAX_TOKENS, WAIT_SECONDS)),
        ],
        cwd=REPO_ROOT,
        env=process_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert killer.stdout is not None
    if killer.stdout.readline().strip() != "watching":
        killer.kill()
        _, errors = killer.communicate()
        raise AssertionError(f"the killer did not start: {errors}")
    return killer


def _killed(killer: subprocess.Popen[str], tmp_path: Path) -> dict[str, dict[str, int]]:
    """Per request live on the worker at the kill: its committed tokens and linked blocks."""
    _, errors = killer.communicate(timeout=WAIT_SECONDS + 60)
    assert killer.returncode == 0, errors
    frozen: dict[str, dict[str, int]] = json.loads((tmp_path / "frozen.json").read_text())
    return frozen


def _keys_of(redis_server: RedisServer, request_ids: list[str]) -> list[str]:
    """Every key of the store's schema that belongs to one of ``request_ids``."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        keys = [k.decode() for k in client.scan_iter(match=schema_pattern(), count=1000)]
    finally:
        client.close()
    tags = {"{" + request_id + "}" for request_id in request_ids}
    return [key for key in keys if any(tag in key for tag in tags)]


def test_sigkill_with_no_notice_all_complete_with_bounded_recompute(
    doomed_and_spare: list[WorkerProcess],
    redis_server: RedisServer,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    doomed, spare = doomed_and_spare
    prompts = _prompts()
    references = offline_reference(tiny_model, prompts, MAX_TOKENS, MAX_MODEL_LEN, tmp_path)
    coordinator: CoordinatorProcess = start_coordinator(
        *("--worker", doomed.address),
        *("--standby", spare.address),
        *("--failover-policy", "resume"),
        *("--lost-after-seconds", "2"),
        *("--max-seqs-per-worker", str(RUNNING_SLOTS)),
        *("--redis-url", redis_server.url),
        *("--record-retention-seconds", str(RECORD_RETENTION_SECONDS)),
        *("--model", str(tiny_model)),
        log_dir=tmp_path,
    )
    traces = [StreamTrace(f"abrupt-32-{i}") for i in range(STREAMS)]
    killer = _killer(redis_server, doomed, [t.request_id for t in traces], tmp_path)
    try:

        def read(i: int) -> None:
            trace = traces[i]
            try:
                for response in coordinator.inference.Generate(
                    greedy(prompts[i], MAX_TOKENS, trace.request_id),
                    timeout=STREAM_TIMEOUT_SECONDS,
                ):
                    trace.record(response)
            except grpc.RpcError as error:
                trace.error = error

        threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(STREAMS)]
        for thread in threads:
            thread.start()

        frozen = _killed(killer, tmp_path)
        doomed.kill()
        assert not any(t.finish_reason for t in traces), "a stream finished before the kill"
        # Told by the store at the kill, not by the clients: a queued one can have its first
        # tokens from the survivor by the time this thread looks.
        queued_at_kill = [t.request_id for t in traces if t.request_id not in frozen]
        assert len(frozen) == RUNNING_SLOTS, frozen

        for thread in threads:
            thread.join(STREAM_TIMEOUT_SECONDS)
        assert not any(thread.is_alive() for thread in threads), "a stream never ended"
    finally:
        if killer.poll() is None:
            killer.kill()
        coordinator.stop()

    for trace, reference in zip(traces, references, strict=True):
        rid = trace.request_id
        assert trace.error is None, f"{rid}: {trace.error}"
        assert trace.finish_reason == common_pb2.FINISH_REASON_LENGTH, rid
        assert trace.duplicates == 0 and trace.gaps == 0, f"{rid}: not exactly once"
        assert trace.token_ids == reference, f"{rid}: differs from the uninterrupted run"
        recovered = [e for e in trace.events if e.kind == common_pb2.EVENT_KIND_RECOVERED]
        if rid in queued_at_kill:
            assert not recovered, f"{rid} was queued: nothing to recover"
            assert set(trace.token_workers) == {"spare"}, rid
            continue
        assert len(recovered) == 1, f"{rid}: events {trace.events}"
        event = recovered[0]
        assert (event.from_worker, event.to_worker) == ("doomed", "spare"), rid
        assert event.loaded_tokens >= BLOCK_TOKENS, f"{rid}: no persisted block loaded: {event}"
        assert event.recomputed_tokens < BLOCK_TOKENS, f"{rid}: unbounded recompute: {event}"
        # Resumed from what the client had received from the doomed worker (the coordinator
        # hands it over), or from what the store held at the kill where that was more.
        switch = trace.token_workers.index("spare")
        context = PROMPT_TOKENS + max(frozen[rid]["committed"], switch)
        assert event.loaded_tokens + event.recomputed_tokens == context - 1, f"{rid}: {event}"
        assert switch and set(trace.token_workers[:switch]) == {"doomed"}, rid
        assert set(trace.token_workers[switch:]) == {"spare"}, rid

    # Nothing of these requests stays in Redis: the workers delete their keys when a request
    # ends, and the coordinator's records expire after their retention.
    request_ids = [t.request_id for t in traces]
    wait_until(
        lambda: not _keys_of(redis_server, request_ids), "every request key gone", timeout=60
    )
