"""Preempt's edges, on a worker of their own: a deadline that already passed, and an idle
worker."""

from __future__ import annotations

import time
from pathlib import Path

from protos.spotinfer.v1 import common_pb2, worker_pb2
from spotinfer.local.worker_process import WorkerProcess
from store import RedisStore, RequestStatus
from tests.notice.conftest import worker_flags
from tests.resume.streams import STREAM_TIMEOUT_SECONDS, StreamReader, greedy_request
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until


def test_flush_past_its_deadline_reports_requests_not_complete_and_idle_returns_at_once(
    tiny_model: Path, redis_server: RedisServer, store: RedisStore, tmp_path: Path
) -> None:
    with WorkerProcess(
        tiny_model,
        *worker_flags(redis_server.url, "lazy"),
        "--worker-id",
        "worker-late",
        log_dir=tmp_path,
    ) as worker:
        request_id = "late-flush-1"
        reader = StreamReader(
            worker.stub.Generate(
                greedy_request(request_id, list(range(200, 240)), 600),
                timeout=STREAM_TIMEOUT_SECONDS,
            )
        )
        wait_until(lambda: reader.done or len(reader.tokens()) >= 20, "tokens flowing")
        assert not reader.done, f"the stream ended early: {reader.error} {reader.responses[-1:]}"

        progress = list(
            worker.stub.Preempt(
                worker_pb2.PreemptRequest(deadline_unix=time.time() - 1.0), timeout=60
            )
        )

        assert [p.request_id for p in progress] == [request_id]
        assert not progress[0].complete
        reader.join()
        assert reader.responses[-1].event.kind == common_pb2.EVENT_KIND_NOTICE
        # Paused all the same (best effort): live in the store for a standby.
        wait_until(
            lambda: store.get_request(request_id).status == RequestStatus.PAUSED,
            "the request marked paused",
        )

        # Idle now: nothing to pause, the stream ends at once.
        assert list(worker.stub.Preempt(worker_pb2.PreemptRequest(), timeout=10)) == []
