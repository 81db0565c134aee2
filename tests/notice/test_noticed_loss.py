"""Noticed loss: the cloud announces the VM's end; the daemon has the worker pause and persist
every request; a standby resumes each with nothing recomputed and identical output.

Real processes only: a redis-server, `python -m worker` processes with the spot KV connector,
`python -m context_daemon` watching a local HTTP server that speaks the cloud's metadata
format, the daemon reaching its worker over a unix socket.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from protos.spotinfer.v1 import common_pb2, worker_pb2
from spotinfer.local.metadata_servers import AwsImds, GcpMetadata
from spotinfer.local.worker_process import WorkerProcess
from store import RedisStore, RequestStatus
from tests.notice.conftest import Node, start_node
from tests.notice.events import NoticeSubscriber, iso_utc
from tests.resume.conftest import BLOCK_TOKENS
from tests.resume.streams import (
    STREAM_TIMEOUT_SECONDS,
    StreamReader,
    generate,
    greedy_request,
    resume_stream,
)
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until

# The tiny model decodes a few hundred tokens a second here: the notice comes after
# TOKENS_BEFORE_NOTICE and must be acted on before the rest of MAX_TOKENS is generated.
MAX_TOKENS = 900
PROMPT_TOKENS = 50
# Past the first full chunk already; by the time the pause lands the context holds full
# chunks and a partial tail (checked).
TOKENS_BEFORE_NOTICE = BLOCK_TOKENS - PROMPT_TOKENS + 22
AWS_NOTICE_SECONDS = 120.0


@pytest.fixture(scope="module", params=["lazy", "eager"])
def aws_node(
    request: pytest.FixtureRequest,
    tiny_model: Path,
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Node]:
    policy = str(request.param)
    with ExitStack() as stack:
        yield start_node(
            stack,
            tiny_model,
            redis_server.url,
            policy,
            f"worker-a-{policy}",
            AwsImds(),
            "aws",
            tmp_path_factory.mktemp(f"aws-{policy}"),
        )


def run_until_notice(
    node: Node, request_id: str, prompt: list[int], announce: Callable[[], None]
) -> tuple[StreamReader, NoticeSubscriber]:
    """Generate on A; once it is well into the request, announce the VM's end; return when
    A's stream has ended."""
    subscriber = NoticeSubscriber(node.daemon)
    reader = StreamReader(
        node.worker.stub.Generate(
            greedy_request(request_id, prompt, MAX_TOKENS), timeout=STREAM_TIMEOUT_SECONDS
        )
    )
    wait_until(
        lambda: reader.done or len(reader.tokens()) >= TOKENS_BEFORE_NOTICE,
        f"{TOKENS_BEFORE_NOTICE} tokens of {request_id}",
    )
    announce()
    reader.join()
    return reader, subscriber


def check_paused_stream(reader: StreamReader, worker_id: str) -> list[int]:
    """A's stream ends without a finish reason, with a NOTICE event; returns A's tokens."""
    assert reader.error is None, f"the stream must end cleanly, got {reader.error}"
    responses = reader.responses
    assert all(r.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for r in responses), (
        "the request finished before the notice; the test proves nothing"
    )
    last = responses[-1]
    assert last.event.kind == common_pb2.EVENT_KIND_NOTICE
    assert last.event.detail == "paused for migration"
    assert last.event.from_worker == worker_id
    received = reader.tokens()
    assert last.index == len(received)
    assert len(received) >= TOKENS_BEFORE_NOTICE
    return received


def check_migration(
    node: Node,
    standby: WorkerProcess,
    store: RedisStore,
    subscriber: NoticeSubscriber,
    request_id: str,
    prompt: list[int],
    received: list[int],
) -> None:
    """The daemon reported the request complete; B resumes it with nothing recomputed and
    the client's assembled output equals an uninterrupted run."""
    wait_until(lambda: subscriber.flush_report(request_id) is not None, "the flush report")
    report = subscriber.flush_report(request_id)
    assert report is not None and report.complete, f"flush not complete: {report}"
    assert report.tail_persisted
    context_tokens = report.context_tokens
    assert context_tokens == len(prompt) + report.committed_tokens
    assert report.persisted_blocks == (context_tokens - 1) // BLOCK_TOKENS >= 1
    assert (context_tokens - 1) % BLOCK_TOKENS, "no partial tail; pick another notice point"
    record = store.get_request(request_id)
    assert record.status == RequestStatus.PAUSED
    # A said no more: it is not serving and refuses new work.
    assert node.worker.health() == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as refused:
        list(node.worker.stub.Generate(greedy_request("too-late", prompt, 4), timeout=30))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    event, resumed = resume_stream(standby, request_id, from_index=len(received))

    assert event.kind == common_pb2.EVENT_KIND_MIGRATED
    assert event.from_worker == node.worker_id and event.to_worker == "worker-b"
    assert event.recomputed_tokens == 0
    assert event.loaded_tokens == context_tokens - 1
    reference = generate(standby, greedy_request(f"{request_id}-reference", prompt, MAX_TOKENS))
    assert received + resumed == reference


def test_aws_notice_flushes_and_standby_resumes_without_recompute(
    aws_node: Node, standby: WorkerProcess, store: RedisStore
) -> None:
    imds = aws_node.metadata
    assert isinstance(imds, AwsImds)
    worker_id = aws_node.worker_id
    request_id = f"aws-notice-{worker_id}"
    prompt = list(range(40 + len(worker_id), 40 + len(worker_id) + PROMPT_TOKENS))

    def announce() -> None:
        imds.instance_action = {
            "action": "terminate",
            "time": iso_utc(time.time() + AWS_NOTICE_SECONDS),
        }

    reader, subscriber = run_until_notice(aws_node, request_id, prompt, announce)
    try:
        received = check_paused_stream(reader, worker_id)
        notices = [e for e in subscriber.events if not e.HasField("flush")]
        assert notices and notices[0].source == "aws" and notices[0].action == "terminate"
        assert notices[0].deadline_unix > time.time()
        assert imds.seen("PUT", "/latest/api/token"), "IMDSv2: the daemon must get a token"
        check_migration(aws_node, standby, store, subscriber, request_id, prompt, received)
    finally:
        subscriber.close()

    # The worker is idle now: another Preempt returns at once, with nothing to report.
    assert list(aws_node.worker.stub.Preempt(worker_pb2.PreemptRequest(), timeout=10)) == []


def test_gcp_preemption_flushes_and_standby_resumes_without_recompute(
    tiny_model: Path,
    redis_server: RedisServer,
    standby: WorkerProcess,
    store: RedisStore,
    tmp_path: Path,
) -> None:
    with ExitStack() as stack:
        node = start_node(
            stack,
            tiny_model,
            redis_server.url,
            "lazy",
            "worker-a-gcp",
            GcpMetadata(),
            "gcp",
            tmp_path,
        )
        metadata = node.metadata
        assert isinstance(metadata, GcpMetadata)
        request_id = "gcp-notice-1"
        prompt = list(range(400, 400 + PROMPT_TOKENS))
        reader, subscriber = run_until_notice(
            node, request_id, prompt, lambda: metadata.set_preempted(True)
        )
        try:
            received = check_paused_stream(reader, "worker-a-gcp")
            notices = [e for e in subscriber.events if not e.HasField("flush")]
            assert notices and notices[0].source == "gcp" and notices[0].action == "preempt"
            check_migration(node, standby, store, subscriber, request_id, prompt, received)
        finally:
            subscriber.close()
