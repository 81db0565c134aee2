"""The fuzzer's findings, each as its smallest input: once a server fault, now a clear status."""

from __future__ import annotations

import math
from typing import Any

import grpc
import pytest
import requests

from protos.spotinfer.v1 import control_pb2, worker_pb2
from tests.coordinator.conftest import status_of
from tests.fuzz.conftest import DEAD_ADDRESSES, FuzzCluster


def test_bytes_that_do_not_decode_are_invalid_argument_not_unknown(fuzz_cluster: FuzzCluster):
    """gRPC answered UNKNOWN ("Exception deserializing request") for b"\\x00"."""
    generate = fuzz_cluster.channel.unary_stream(
        "/spotinfer.v1.Inference/Generate", request_serializer=lambda raw: raw
    )
    with pytest.raises(grpc.RpcError) as raised:
        list(generate(b"\x00", timeout=10))
    assert status_of(raised.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not decode" in raised.value.details()  # type: ignore[attr-defined]
    cancel = fuzz_cluster.channel.unary_unary(
        "/spotinfer.v1.Inference/Cancel", request_serializer=lambda raw: raw
    )
    with pytest.raises(grpc.RpcError) as raised:
        cancel(b"\n\x02\xff\xfe", timeout=10)  # a string field that is not UTF-8
    assert status_of(raised.value) == grpc.StatusCode.INVALID_ARGUMENT


def test_drain_of_a_worker_that_does_not_answer_is_unavailable(fuzz_cluster: FuzzCluster):
    """Drain passed the worker's own UNAVAILABLE up as an unexpected error: INTERNAL."""
    with pytest.raises(grpc.RpcError) as raised:
        fuzz_cluster.coordinator.control.Drain(
            control_pb2.DrainWorkerRequest(worker_id=DEAD_ADDRESSES[0]), timeout=10
        )
    assert status_of(raised.value) == grpc.StatusCode.UNAVAILABLE
    assert "did not answer" in raised.value.details()  # type: ignore[attr-defined]


@pytest.mark.parametrize("grace", [math.nan, math.inf, -1.0, 1e308])
def test_a_grace_that_is_no_duration_is_invalid_argument(fuzz_cluster: FuzzCluster, grace: float):
    """A NaN or infinite grace reached the worker (Drain) or became the deadline (notice)."""
    control = fuzz_cluster.coordinator.control
    calls = (
        lambda: control.Drain(
            control_pb2.DrainWorkerRequest(worker_id=DEAD_ADDRESSES[0], grace_seconds=grace),
            timeout=10,
        ),
        lambda: control.InjectNotice(
            control_pb2.InjectNoticeRequest(worker_id=DEAD_ADDRESSES[0], grace_seconds=grace),
            timeout=10,
        ),
    )
    for call in calls:
        with pytest.raises(grpc.RpcError) as raised:
            call()
        assert status_of(raised.value) == grpc.StatusCode.INVALID_ARGUMENT
        assert "grace_seconds" in raised.value.details()  # type: ignore[attr-defined]


@pytest.mark.parametrize("n", [":", "two", [1], True])
def test_an_n_that_is_not_a_number_is_400_not_500(fuzz_cluster: FuzzCluster, n: Any):
    """`int(body["n"])` raised ValueError for {"n": ":"}: a 500."""
    response = requests.post(
        fuzz_cluster.coordinator.http_url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 1, "n": n},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert "n must be 1" in response.json()["error"]["message"]


@pytest.mark.parametrize("stop", [1.5, {"a": 1}, [1, "x"], True])
def test_a_stop_that_is_not_strings_is_400_not_500(fuzz_cluster: FuzzCluster, stop: Any):
    """`tuple(str(s) for s in stop)` raised TypeError for {"stop": 1.8e308}: a 500."""
    response = requests.post(
        fuzz_cluster.coordinator.http_url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stop": stop},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert "stop must be" in response.json()["error"]["message"]


@pytest.mark.parametrize("messages", [[[], []], [[{"role": "user", "content": "hi"}]], ["hi"]])
def test_messages_that_are_not_objects_are_400_not_500(fuzz_cluster: FuzzCluster, messages: Any):
    """{"messages": [[], []]}: the chat template read a list of lists as a batch of
    conversations, and the prompt became lists of token ids (a TypeError: a 500)."""
    response = requests.post(
        fuzz_cluster.coordinator.http_url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 1},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert "messages must be objects" in response.json()["error"]["message"]


def test_a_capacity_with_more_free_blocks_than_it_has_is_invalid_argument(
    fuzz_cluster: FuzzCluster,
):
    """RegisterWorker took kv_blocks_free over kv_blocks_total; every ClusterStatus after it
    failed to encode the negative used-block count: INTERNAL "Value out of range"."""
    request = control_pb2.RegisterWorkerRequest(
        address=DEAD_ADDRESSES[0],
        capacity=worker_pb2.WorkerStats(kv_blocks_total=8, kv_blocks_free=1200),
    )
    with pytest.raises(grpc.RpcError) as raised:
        fuzz_cluster.coordinator.control.RegisterWorker(request, timeout=10)
    assert status_of(raised.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert "kv_blocks_free" in raised.value.details()  # type: ignore[attr-defined]
    fuzz_cluster.coordinator.control.ClusterStatus(control_pb2.ClusterStatusRequest(), timeout=10)
