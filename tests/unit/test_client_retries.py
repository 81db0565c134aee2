"""The client's retries against a tiny in-process gRPC server: a refusal is made again after
the server's retry hint with jitter, a bounded number of times; without a hint the waits
back off exponentially with jitter. Waits are recorded, never slept."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.requests import FinishReason, Sampling
from protos.spotinfer.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from spotinfer.backoff import Backoff
from spotinfer.client import Client, ClientConfig

Serve = Callable[..., tuple[Client, list[float]]]
HINT_MS = 1500
OUTPUT = [11, 12, 13]


class Highest(random.Random):
    """Jitter that always draws the top of its range: the longest wait the rule allows."""

    def uniform(self, a: float, b: float) -> float:
        return b


class Refusing(inference_pb2_grpc.InferenceServicer):
    """Refuses the first ``refusals`` Generate calls with ``code`` (and the hint, if any),
    then answers the whole output at once. Attach knows no request (NOT_FOUND)."""

    def __init__(self, refusals: int, code: grpc.StatusCode, hint_ms: int | None) -> None:
        self.refusals = refusals
        self.code = code
        self.hint_ms = hint_ms
        self.generate_ids: list[str] = []

    def Generate(  # noqa: N802
        self, request: common_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[common_pb2.GenerateResponse]:
        self.generate_ids.append(request.request_id)
        if len(self.generate_ids) <= self.refusals:
            if self.hint_ms is not None:
                context.set_trailing_metadata((("retry-after-ms", str(self.hint_ms)),))
            context.abort(self.code, "no worker became available within 60 s")
        yield common_pb2.GenerateResponse(
            request_id=request.request_id,
            index=0,
            token_ids=OUTPUT,
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
        )

    def Attach(  # noqa: N802
        self, request: inference_pb2.AttachRequest, context: grpc.ServicerContext
    ) -> Iterator[common_pb2.GenerateResponse]:
        context.abort(grpc.StatusCode.NOT_FOUND, "no such request")
        yield common_pb2.GenerateResponse()

    def Cancel(  # noqa: N802
        self, request: inference_pb2.CancelRequest, context: grpc.ServicerContext
    ) -> inference_pb2.CancelResponse:
        return inference_pb2.CancelResponse(cancelled=False)


@pytest.fixture
def serve() -> Iterator[Serve]:
    """Starts a server for a service; the client it gives records its waits."""
    servers: list[grpc.Server] = []

    def start(service: Refusing, **config: object) -> tuple[Client, list[float]]:
        server = grpc.server(ThreadPoolExecutor(2))
        inference_pb2_grpc.add_InferenceServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        waits: list[float] = []
        client_config = ClientConfig(targets=(f"127.0.0.1:{port}",), **config)  # type: ignore[arg-type]
        return Client(client_config, sleep=waits.append, rng=Highest()), waits

    yield start
    for server in servers:
        server.stop(None)


def _generate(client: Client) -> list[int]:
    with client:
        output = client.generate([1, 2, 3], Sampling(max_tokens=3), request_id="r-1")
    assert output.finish_reason == FinishReason.LENGTH
    return list(output.token_ids)


def test_a_refused_submit_is_made_again_once_the_hint_has_passed(serve: Serve) -> None:
    service = Refusing(2, grpc.StatusCode.RESOURCE_EXHAUSTED, HINT_MS)
    client, waits = serve(service)
    assert _generate(client) == OUTPUT
    assert service.generate_ids == ["r-1"] * 3, "submitted again under the same id"
    # At least the hint, at most twice it (the jitter), never above the backoff's cap.
    assert waits == [3.0, 3.0]


def test_refusals_past_the_bound_reach_the_caller_with_their_status(serve: Serve) -> None:
    service = Refusing(10, grpc.StatusCode.RESOURCE_EXHAUSTED, HINT_MS)
    client, waits = serve(service, busy_attempts=2)
    with pytest.raises(grpc.RpcError) as refused:
        _generate(client)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert len(service.generate_ids) == 3 and len(waits) == 2


def test_the_jitter_on_a_hint_stays_under_the_backoff_cap(serve: Serve) -> None:
    service = Refusing(1, grpc.StatusCode.RESOURCE_EXHAUSTED, HINT_MS)
    client, waits = serve(service, backoff_max_seconds=2.0)
    assert _generate(client) == OUTPUT
    assert waits == [2.0]


def test_without_a_hint_an_unavailable_submit_backs_off_exponentially(serve: Serve) -> None:
    # UNAVAILABLE: the client attaches (NOT_FOUND: it never started), then submits again.
    service = Refusing(1, grpc.StatusCode.UNAVAILABLE, None)
    client, waits = serve(service, backoff_base_seconds=0.1)
    assert _generate(client) == OUTPUT
    assert waits == [0.1, 0.2]


def test_unhinted_waits_double_up_to_the_cap_and_a_long_hint_is_waited_in_full() -> None:
    backoff = Backoff(base_seconds=0.25, max_seconds=5.0)
    highest = [backoff.delay_seconds(n, None, Highest()) for n in range(1, 8)]
    assert highest == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    rng = random.Random(7)
    assert all(0 <= backoff.delay_seconds(3, None, rng) <= 1.0 for _ in range(100))
    assert all(1.0 <= backoff.delay_seconds(1, 1.0, rng) <= 2.0 for _ in range(100))
    assert backoff.delay_seconds(1, 30.0, Highest()) == 30.0
    with pytest.raises(ValueError, match="base_seconds <= max_seconds"):
        Backoff(base_seconds=2.0, max_seconds=1.0)
