"""A real coordinator process with TLS, mutual TLS on its internal port, API keys and per-key
limits: what the public gRPC and HTTP fronts refuse, and how."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.channels import PLAINTEXT, TransportConfig, sync_channel
from protos.spotinfer.v1 import common_pb2, control_pb2, control_pb2_grpc, inference_pb2_grpc
from spotinfer.local.coordinator_process import CoordinatorProcess
from tests.security.conftest import Keys, Pki

TIMEOUT_SECONDS = 10


@pytest.fixture(scope="module")
def coordinator(
    pki: Pki, keys: Keys, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CoordinatorProcess]:
    node = pki.nodes["coordinator"]
    process = CoordinatorProcess(
        *("--transport-ca-file", str(pki.ca.cert)),
        *("--transport-cert-file", str(node.cert)),
        *("--transport-key-file", str(node.key)),
        *("--api-keys-file", str(keys.file)),
        *("--api-keys-requests-per-second", "0.05"),
        *("--api-keys-burst", "2"),
        log_dir=tmp_path_factory.mktemp("coordinator-logs"),
        transport=pki.transport("operator"),
    )
    with process:
        yield process


def _public(
    coordinator: CoordinatorProcess, transport: TransportConfig, key: str = ""
) -> grpc.Channel:
    return sync_channel(coordinator.address, transport=transport, api_key=key)


def _status_code(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _cluster_status(channel: grpc.Channel) -> grpc.StatusCode:
    stub = control_pb2_grpc.ControlStub(channel)
    return _status_code(
        lambda: stub.ClusterStatus(control_pb2.ClusterStatusRequest(), timeout=TIMEOUT_SECONDS)
    )


def _generate(channel: grpc.Channel) -> grpc.RpcError | None:
    stub = inference_pb2_grpc.InferenceStub(channel)
    request = common_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3])
    try:
        for _ in stub.Generate(request, timeout=TIMEOUT_SECONDS):
            pass
    except grpc.RpcError as exc:
        return exc
    return None


def test_the_public_front_refuses_plaintext(coordinator: CoordinatorProcess, keys: Keys) -> None:
    with _public(coordinator, PLAINTEXT, keys.admin) as channel:
        assert _cluster_status(channel) == grpc.StatusCode.UNAVAILABLE


def test_no_or_a_wrong_key_is_unauthenticated(
    coordinator: CoordinatorProcess, pki: Pki, keys: Keys
) -> None:
    with _public(coordinator, pki.client_only()) as channel:
        error = _generate(channel)
        assert error is not None and error.code() == grpc.StatusCode.UNAUTHENTICATED
    wrong = keys.tenant[:-2] + "xx"
    with _public(coordinator, pki.client_only(), wrong) as channel:
        error = _generate(channel)
        assert error is not None and error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _cluster_status(channel) == grpc.StatusCode.UNAUTHENTICATED


def test_control_needs_an_admin_key_or_an_operator_certificate(
    coordinator: CoordinatorProcess, pki: Pki, keys: Keys
) -> None:
    with _public(coordinator, pki.client_only(), keys.tenant) as channel:
        assert _cluster_status(channel) == grpc.StatusCode.PERMISSION_DENIED
    with _public(coordinator, pki.client_only(), keys.admin) as channel:
        assert _cluster_status(channel) == grpc.StatusCode.OK
    assert coordinator.channel is not None  # the operator certificate, internal port
    assert _cluster_status(coordinator.channel) == grpc.StatusCode.OK


def test_register_worker_from_a_non_node_identity_is_refused(
    coordinator: CoordinatorProcess, pki: Pki, keys: Keys
) -> None:
    request = control_pb2.RegisterWorkerRequest(address="10.9.9.9:50061", worker_id="planted")

    def register(channel: grpc.Channel) -> grpc.StatusCode:
        stub = control_pb2_grpc.ControlStub(channel)
        return _status_code(lambda: stub.RegisterWorker(request, timeout=TIMEOUT_SECONDS))

    with _public(coordinator, pki.client_only(), keys.admin) as channel:
        assert register(channel) == grpc.StatusCode.PERMISSION_DENIED
    # A coordinator's certificate is a node, but not one that registers workers.
    internal = sync_channel(coordinator.internal_address, transport=pki.transport("coordinator"))
    with internal:
        assert register(internal) == grpc.StatusCode.PERMISSION_DENIED
    assert coordinator.channel is not None
    listed = control_pb2_grpc.ControlStub(coordinator.channel).ListWorkers(
        control_pb2.ListWorkersRequest(), timeout=TIMEOUT_SECONDS
    )
    assert [w.worker_id for w in listed.workers] == []


def test_the_internal_port_refuses_no_certificate_and_another_ca(
    coordinator: CoordinatorProcess, pki: Pki, keys: Keys
) -> None:
    for transport in (pki.client_only(), pki.foreign_client()):
        with sync_channel(
            coordinator.internal_address, transport=transport, api_key=keys.admin
        ) as channel:
            assert _cluster_status(channel) == grpc.StatusCode.UNAVAILABLE


def test_a_key_over_its_rate_is_resource_exhausted_with_a_retry_hint(
    coordinator: CoordinatorProcess, pki: Pki, keys: Keys
) -> None:
    with _public(coordinator, pki.client_only(), keys.limited) as channel:
        # A burst of two: both get past the limits (then find no worker).
        for _ in range(2):
            error = _generate(channel)
            assert error is not None and error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
        error = _generate(channel)
    assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    hints = dict(error.trailing_metadata() or ())
    assert int(hints["retry-after-ms"]) > 1000


def _https(
    coordinator: CoordinatorProcess, pki: Pki, path: str, key: str = "", body: dict | None = None
) -> tuple[int, dict, dict]:
    context = ssl.create_default_context(cafile=str(pki.ca.cert))
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(coordinator.http_url + path, data=data)
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, context=context, timeout=TIMEOUT_SECONDS) as reply:
            return reply.status, dict(reply.headers), json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def test_http_needs_a_key_and_answers_openai_shaped_errors(
    coordinator: CoordinatorProcess, pki: Pki, keys: Keys
) -> None:
    assert coordinator.http_url.startswith("https://")
    status, _, body = _https(coordinator, pki, "/v1/models")
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key"
    assert body["error"]["type"] == "invalid_request_error"
    status, _, body = _https(coordinator, pki, "/v1/models", key="spk_nope_nope")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _, body = _https(coordinator, pki, "/v1/models", key=keys.tenant)
    assert status == 200 and body["object"] == "list"


def test_http_refuses_plaintext_when_tls_is_configured(coordinator: CoordinatorProcess) -> None:
    plain = coordinator.http_url.replace("https://", "http://") + "/v1/models"
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(plain, timeout=TIMEOUT_SECONDS)


def test_http_rate_limit_is_429_with_retry_after(
    coordinator: CoordinatorProcess, pki: Pki, keys: Keys, tmp_path: Path
) -> None:
    # The limited key may have spent its burst on gRPC: the limits are per key, not per front.
    answers = [_https(coordinator, pki, "/v1/models", key=keys.limited) for _ in range(3)]
    limited = [a for a in answers if a[0] == 429]
    assert limited, [a[0] for a in answers]
    status, headers, body = limited[0]
    assert body["error"]["type"] == "rate_limit_error"
    assert int(headers["Retry-After"]) >= 1
