"""The descriptor-built strategies reach every field kind, on a message made for the test that
has one field of each (so a field added to a real proto is fuzzed without a change here)."""

from __future__ import annotations

import math
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, given, settings

from protos.spotinfer.v1 import common_pb2
from tests.fuzz.proto_strategies import message_bytes, messages, wire_garbage

F = descriptor_pb2.FieldDescriptorProto
SCALARS = {
    "f_double": F.TYPE_DOUBLE,
    "f_float": F.TYPE_FLOAT,
    "f_int64": F.TYPE_INT64,
    "f_uint64": F.TYPE_UINT64,
    "f_int32": F.TYPE_INT32,
    "f_fixed64": F.TYPE_FIXED64,
    "f_fixed32": F.TYPE_FIXED32,
    "f_bool": F.TYPE_BOOL,
    "f_string": F.TYPE_STRING,
    "f_bytes": F.TYPE_BYTES,
    "f_sint32": F.TYPE_SINT32,
    "f_sint64": F.TYPE_SINT64,
}


def every_kind() -> Any:
    """A proto3 message with a field of each scalar kind, an enum, a repeated field, a
    nested message, a oneof, a proto3 optional and a map."""
    file = descriptor_pb2.FileDescriptorProto(
        name="fuzz_every_kind.proto", package="fuzztest", syntax="proto3"
    )
    file.enum_type.add(name="Color").value.add(name="COLOR_UNSPECIFIED", number=0)
    inner = file.message_type.add(name="Inner")
    inner.field.add(name="x", number=1, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL)
    entry = file.message_type.add(name="Outer").nested_type.add(name="TagsEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL)
    outer = file.message_type[1]
    for number, (name, kind) in enumerate(SCALARS.items(), start=1):
        outer.field.add(name=name, number=number, type=kind, label=F.LABEL_OPTIONAL)
    add = outer.field.add
    add(name="color", number=20, type=F.TYPE_ENUM, type_name=".fuzztest.Color", label=1)
    add(name="many", number=21, type=F.TYPE_UINT32, label=F.LABEL_REPEATED)
    add(name="inner", number=22, type=F.TYPE_MESSAGE, type_name=".fuzztest.Inner", label=1)
    outer.oneof_decl.add(name="choice")
    outer.oneof_decl.add(name="_maybe")
    add(name="pick_a", number=23, type=F.TYPE_STRING, label=1, oneof_index=0)
    add(name="pick_b", number=24, type=F.TYPE_INT64, label=1, oneof_index=0)
    add(name="maybe", number=25, type=F.TYPE_INT32, label=1, oneof_index=1, proto3_optional=True)
    add(
        name="tags",
        number=26,
        type=F.TYPE_MESSAGE,
        type_name=".fuzztest.Outer.TagsEntry",
        label=F.LABEL_REPEATED,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return pool.FindMessageTypeByName("fuzztest.Outer")


def test_every_field_kind_is_set_and_extremes_appear():
    descriptor = every_kind()
    seen: set[str] = set()
    values: list[Any] = []

    @settings(
        max_examples=400,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(messages(descriptor))
    def collect(message: Message) -> None:
        for field, value in message.ListFields():
            seen.add(field.name)
            values.append(value)
        assert message.WhichOneof("choice") in (None, "pick_a", "pick_b")
        GetMessageClass(descriptor).FromString(message.SerializeToString())

    collect()
    assert seen == {f.name for f in descriptor.fields}
    floats = [v for v in values if isinstance(v, float)]
    assert any(math.isnan(v) for v in floats) and any(math.isinf(v) for v in floats)
    assert 2**63 - 1 in values or -(2**63) in values
    assert any(isinstance(v, int) and v not in (0,) and v > 2**32 for v in values)


def test_serialized_inputs_parse_and_garbage_mostly_does_not():
    descriptor = common_pb2.GenerateRequest.DESCRIPTOR
    parsed = {"valid": 0, "garbage": 0}

    @settings(
        max_examples=200,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(message_bytes(descriptor), wire_garbage(descriptor))
    def collect(valid: bytes, garbage: bytes) -> None:
        common_pb2.GenerateRequest.FromString(valid)  # unknown fields included: still parses
        parsed["valid"] += 1
        try:
            common_pb2.GenerateRequest.FromString(garbage)
        except Exception:
            parsed["garbage"] += 1

    collect()
    assert parsed["valid"] == 200
    assert parsed["garbage"] > 50, parsed


def test_an_enum_field_also_gets_numbers_it_does_not_define():
    field: FieldDescriptor = common_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["sla_class"]
    assert field.enum_type is not None
    known = {v.number for v in field.enum_type.values}
    seen: set[int] = set()

    @settings(max_examples=200, deadline=None, derandomize=True, database=None)
    @given(messages(common_pb2.GenerateRequest.DESCRIPTOR))
    def collect(message: Message) -> None:
        seen.add(message.sla_class)  # type: ignore[attr-defined]

    collect()
    assert seen - known
