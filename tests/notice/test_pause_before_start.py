"""A request paused before its worker computed anything of it: admitted, but still waiting in
vLLM's queue (its one running slot is taken) when the notice comes. Its flush has nothing
to write, so it is complete as soon as the pause lands, and the standby's prefill of its
prompt is its first computation, not a recompute."""

from __future__ import annotations

import time
from pathlib import Path

from protos.spotinfer.v1 import common_pb2, worker_pb2
from spotinfer.local.worker_process import WorkerProcess
from store import RedisStore, RequestNotFound, RequestStatus
from tests.notice.conftest import worker_flags
from tests.resume.streams import (
    STREAM_TIMEOUT_SECONDS,
    StreamReader,
    generate,
    greedy_request,
    resume_stream,
)
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until

RUNNING_PROMPT = list(range(300, 340))
WAITING_PROMPT = [10 + (7 * j) % 480 for j in range(62)]  # 61 tokens of KV once prefilled
RUNNING_MAX_TOKENS = 900
WAITING_MAX_TOKENS = 40
NOTICE_SECONDS = 20.0


def _status(store: RedisStore, request_id: str) -> RequestStatus | None:
    try:
        return store.get_request(request_id).status
    except RequestNotFound:
        return None


def test_request_paused_before_it_was_scheduled_flushes_complete_and_recomputes_nothing(
    tiny_model: Path,
    redis_server: RedisServer,
    standby: WorkerProcess,
    store: RedisStore,
    tmp_path: Path,
) -> None:
    with WorkerProcess(
        tiny_model,
        *worker_flags(redis_server.url, "eager"),
        *("--max-num-seqs", "1"),
        *("--worker-id", "worker-one-slot"),
        log_dir=tmp_path,
    ) as worker:
        running_id, waiting_id = "unstarted-running", "unstarted-waiting"
        running = StreamReader(
            worker.stub.Generate(
                greedy_request(running_id, RUNNING_PROMPT, RUNNING_MAX_TOKENS),
                timeout=STREAM_TIMEOUT_SECONDS,
            )
        )
        wait_until(lambda: running.done or len(running.tokens()) >= 20, "tokens flowing")
        waiting = StreamReader(
            worker.stub.Generate(
                greedy_request(waiting_id, WAITING_PROMPT, WAITING_MAX_TOKENS),
                timeout=STREAM_TIMEOUT_SECONDS,
            )
        )
        wait_until(lambda: _status(store, waiting_id) == RequestStatus.RUNNING, "admitted")
        assert not running.done and not waiting.responses, "the second request must wait"

        started = time.time()
        progress = {
            p.request_id: p
            for p in worker.stub.Preempt(
                worker_pb2.PreemptRequest(deadline_unix=started + NOTICE_SECONDS), timeout=60
            )
        }
        flushed_in = time.time() - started
        running.join()
        waiting.join()

    assert set(progress) == {running_id, waiting_id}
    unstarted = progress[waiting_id]
    assert unstarted.complete, f"nothing to flush, yet not complete: {unstarted}"
    assert unstarted.committed_tokens == 0 and unstarted.persisted_blocks == 0
    assert unstarted.context_tokens == len(WAITING_PROMPT)
    assert progress[running_id].complete, progress[running_id]
    assert flushed_in < NOTICE_SECONDS / 2, f"the flush waited for its deadline: {flushed_in:.1f} s"
    assert waiting.error is None and waiting.responses[-1].event.kind == (
        common_pb2.EVENT_KIND_NOTICE
    )
    assert not waiting.tokens()
    assert store.get_request(waiting_id).status == RequestStatus.PAUSED

    event, resumed = resume_stream(standby, waiting_id, 0)
    assert event.kind == common_pb2.EVENT_KIND_MIGRATED
    assert (event.loaded_tokens, event.recomputed_tokens) == (0, 0), event
    reference = generate(
        standby, greedy_request(f"{waiting_id}-reference", WAITING_PROMPT, WAITING_MAX_TOKENS)
    )
    assert resumed == reference

    received = running.tokens()
    event, rest = resume_stream(standby, running_id, len(received))
    assert event.kind == common_pb2.EVENT_KIND_MIGRATED and event.recomputed_tokens == 0, event
    assert event.loaded_tokens == len(RUNNING_PROMPT) + progress[running_id].committed_tokens - 1
    reference = generate(
        standby, greedy_request(f"{running_id}-reference", RUNNING_PROMPT, RUNNING_MAX_TOKENS)
    )
    assert received + rest == reference
