"""The committed generated code is what `make protos` produces from the .proto files."""

from __future__ import annotations

from pathlib import Path

from spotinfer.protogen import PROTO_DIR, REPO_ROOT, generate


def test_committed_code_is_not_stale(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert fresh, "protoc produced nothing"
    for path in fresh:
        committed = REPO_ROOT / PROTO_DIR / path.name
        assert committed.exists(), f"{committed} is missing: run `make protos` and commit"
        assert committed.read_text() == path.read_text(), (
            f"{committed.name} is stale: run `make protos` and commit the result"
        )
    committed_names = {p.name for p in (REPO_ROOT / PROTO_DIR).glob("*_pb2*.py*")}
    assert committed_names == {p.name for p in fresh}, "generated files without a .proto"


def test_public_contract_names() -> None:
    from protos.spotinfer.v1 import common_pb2, inference_pb2

    service = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
    assert {m.name for m in service.methods} >= {"Generate", "Attach", "Cancel"}
    assert common_pb2.FINISH_REASON_CANCELLED == 3
    assert common_pb2.SLA_CLASS_BATCH == 2
    fields = {f.name for f in common_pb2.GenerateRequest.DESCRIPTOR.fields}
    # tenant is set by the coordinator for its workers; a client's value is never read
    assert fields == {
        "request_id",
        "prompt",
        "prompt_token_ids",
        "sampling",
        "sla_class",
        "tenant",
        "priority",
    }
