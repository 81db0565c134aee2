"""Bad input is refused at the coordinator with INVALID_ARGUMENT and a message that names
the problem, before any worker is busy with it."""

from __future__ import annotations

import grpc
import pytest

from protos.spotinfer.v1 import common_pb2
from spotinfer.local.coordinator_process import CoordinatorProcess
from tests.coordinator.conftest import TIMEOUT_SECONDS

PROMPT_IDS = [5, 17, 42, 99]


def _sampling(**fields: object) -> common_pb2.SamplingParams:
    values: dict[str, object] = {"max_tokens": 8}
    values.update(fields)
    return common_pb2.SamplingParams(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("request_fields", "words"),
    [
        ({"sampling": _sampling(max_tokens=0)}, "max_tokens"),
        ({"sampling": _sampling(temperature=-1.0)}, "temperature"),
        ({"sampling": _sampling(top_p=1.5)}, "top_p"),
        ({"sampling": _sampling(top_k=-3)}, "top_k"),
        ({"sampling": _sampling(max_tokens=1021)}, "context length"),
        ({"prompt": "hello"}, "exactly one"),
        ({"prompt_token_ids": [], "prompt": ""}, "empty"),
        ({"prompt_token_ids": [10**6]}, "vocabulary"),
        ({"prompt_token_ids": [7] * 1024}, "1024"),
        ({"request_id": "has space"}, "whitespace"),
    ],
)
def test_invalid_parameters_are_invalid_argument(
    coordinator: CoordinatorProcess, request_fields: dict[str, object], words: str
) -> None:
    fields: dict[str, object] = {"prompt_token_ids": PROMPT_IDS, "sampling": _sampling()}
    fields.update(request_fields)
    request = common_pb2.GenerateRequest(**fields)  # type: ignore[arg-type]
    with pytest.raises(grpc.RpcError) as refused:
        list(coordinator.inference.Generate(request, timeout=TIMEOUT_SECONDS))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in refused.value.details()
