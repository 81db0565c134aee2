"""Hypothesis strategies built from protobuf descriptors, so a field added to a proto is
fuzzed the day it lands.

    message_bytes(GenerateRequest.DESCRIPTOR, overrides)
        └─ messages(): every field of every kind, set or left at its default
             scalars at their extremes (int64 bounds, NaN, ±inf, -0.0), strings with NUL,
             bidi and zero-width characters, enums with unknown numbers, repeated fields,
             nested messages, one member of each oneof (or none), map fields
        └─ SerializeToString() + sometimes unknown fields appended (numbers the message
           does not define, every wire type)

`overrides` maps a field's full name (``spotinfer.v1.SamplingParams.max_tokens``) to an
extra strategy drawn from instead of the generic one half of the time: a fuzzer uses it to
reach the valid path (a token id inside the vocabulary, a small max_tokens) without giving up
the generic values. With ``strict=True`` the overrides are all there is: an overridden field
and every nested message are always set, so most such messages are requests a server serves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

Overrides = Mapping[str, st.SearchStrategy[Any]]

MAX_REPEATED = 8
MAX_TEXT_CHARS = 40
MAX_DEPTH = 4
# Strings that have broken parsers elsewhere: NUL, bidi overrides, zero-width joiners, a BOM,
# lone combining marks, whitespace of every kind, and lengths around the usual limits.
AWKWARD_TEXT = (
    "",
    "\x00",
    "a\x00b",
    "\u202e\u2066abc",
    "\u200b\u200d",
    "\ufeff",
    "\u0301",
    " \t\r\n\x0b\x0c\u00a0\u3000",
    "\U0001f600" * 3,
    "\ufffd\uffff",
    "x" * 128,
    "x" * 129,
    "x" * 4097,
)
_T = FieldDescriptor
_INT_BOUNDS = {
    _T.TYPE_INT32: (-(2**31), 2**31 - 1),
    _T.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _T.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    _T.TYPE_UINT32: (0, 2**32 - 1),
    _T.TYPE_FIXED32: (0, 2**32 - 1),
    _T.TYPE_INT64: (-(2**63), 2**63 - 1),
    _T.TYPE_SINT64: (-(2**63), 2**63 - 1),
    _T.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    _T.TYPE_UINT64: (0, 2**64 - 1),
    _T.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOAT_EXTREMES = (0.0, -0.0, math.nan, math.inf, -math.inf, 1.0, -1.0)
_FLOAT32_MAX = 3.4028234663852886e38


def integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({lo, hi, 0, 1, hi - 1, *((-1,) if lo < 0 else ())})
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


def scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    """The generic strategy of one scalar or enum value of ``field``'s type."""
    kind = field.type
    if kind in _INT_BOUNDS:
        return integers(*_INT_BOUNDS[kind])
    if kind == _T.TYPE_DOUBLE:
        return st.one_of(st.sampled_from(_FLOAT_EXTREMES + (1e308, -1e308)), st.floats())
    if kind == _T.TYPE_FLOAT:
        edges = _FLOAT_EXTREMES + (_FLOAT32_MAX, -_FLOAT32_MAX)
        return st.one_of(st.sampled_from(edges), st.floats(width=32))
    if kind == _T.TYPE_BOOL:
        return st.booleans()
    if kind == _T.TYPE_STRING:
        return st.one_of(st.sampled_from(AWKWARD_TEXT), st.text(max_size=MAX_TEXT_CHARS))
    if kind == _T.TYPE_BYTES:
        return st.binary(max_size=MAX_TEXT_CHARS)
    if kind == _T.TYPE_ENUM:
        assert field.enum_type is not None
        known = [value.number for value in field.enum_type.values]
        # proto3 enums are open: a number the server does not know still parses.
        return st.one_of(st.sampled_from(known), integers(-(2**31), 2**31 - 1))
    raise TypeError(f"no strategy for field {field.full_name} of type {kind}")


def _message_type(field: FieldDescriptor) -> Descriptor:
    assert field.message_type is not None, field.full_name
    return field.message_type


def _paired(
    field: FieldDescriptor, values: st.SearchStrategy[Any]
) -> st.SearchStrategy[list[tuple[FieldDescriptor, Any]]]:
    """``values`` as the one (field, value) pair a message gets for ``field``."""
    return values.map(lambda value: [(field, value)])


def _value(
    field: FieldDescriptor, overrides: Overrides, depth: int, strict: bool
) -> st.SearchStrategy[Any]:
    if field.type in (_T.TYPE_MESSAGE, _T.TYPE_GROUP):
        return messages(_message_type(field), overrides, depth + 1, strict)
    extra = overrides.get(field.full_name)
    if extra is None:
        return scalar(field)
    return extra if strict else st.one_of(extra, scalar(field))


def _always_set(field: FieldDescriptor, overrides: Overrides, strict: bool) -> bool:
    return strict and (field.type == _T.TYPE_MESSAGE or field.full_name in overrides)


def _is_map(field: FieldDescriptor) -> bool:
    return (
        field.type == _T.TYPE_MESSAGE
        and field.message_type is not None
        and field.message_type.GetOptions().map_entry
    )


def _is_repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def _set(message: Message, field: FieldDescriptor, value: Any) -> None:
    if _is_map(field):
        target = getattr(message, field.name)
        value_field = _message_type(field).fields_by_name["value"]
        for key, item in value.items():
            if value_field.type == _T.TYPE_MESSAGE:
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif _is_repeated(field):
        target = getattr(message, field.name)
        if field.type == _T.TYPE_MESSAGE:
            for item in value:
                target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif field.type == _T.TYPE_MESSAGE:
        getattr(message, field.name).CopyFrom(value)
    else:
        setattr(message, field.name, value)


def messages(
    descriptor: Descriptor,
    overrides: Overrides | None = None,
    depth: int = 0,
    strict: bool = False,
) -> st.SearchStrategy[Message]:
    """Messages of ``descriptor``'s type; each field set or not, each oneof at most one."""
    overrides = overrides or {}
    if depth > MAX_DEPTH:
        return st.just(GetMessageClass(descriptor)())
    groups: list[st.SearchStrategy[list[tuple[FieldDescriptor, Any]]]] = []
    in_oneof = {f.number for oneof in descriptor.oneofs for f in oneof.fields}
    for oneof in descriptor.oneofs:
        choices = [_paired(f, _value(f, overrides, depth, strict)) for f in oneof.fields]
        groups.append(st.one_of(st.just([]), *choices))
    for field in descriptor.fields:
        if field.number in in_oneof:
            continue
        if _is_map(field):
            entry = _message_type(field)
            keys = _value(entry.fields_by_name["key"], overrides, depth, strict)
            values = _value(entry.fields_by_name["value"], overrides, depth, strict)
            value: st.SearchStrategy[Any] = st.dictionaries(keys, values, max_size=MAX_REPEATED)
        elif _is_repeated(field):
            value = st.lists(_value(field, overrides, depth, strict), max_size=MAX_REPEATED)
        else:
            value = _value(field, overrides, depth, strict)
        pair = _paired(field, value)
        groups.append(
            pair if _always_set(field, overrides, strict) else st.one_of(st.just([]), pair)
        )

    def build(chosen: list[list[tuple[FieldDescriptor, Any]]]) -> Message:
        message = GetMessageClass(descriptor)()
        for pairs in chosen:
            for field, value in pairs:
                _set(message, field, value)
        return message

    return st.tuples(*groups).map(lambda chosen: build(list(chosen)))


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


@st.composite
def unknown_fields(draw: st.DrawFn, descriptor: Descriptor) -> bytes:
    """Well-formed fields with numbers ``descriptor`` does not define, any wire type."""
    number = draw(st.integers(1, 2**29 - 1).filter(lambda n: n not in descriptor.fields_by_number))
    wire_type = draw(st.sampled_from((0, 1, 2, 5)))
    key = _varint(number << 3 | wire_type)
    if wire_type == 0:
        return key + _varint(draw(st.integers(0, 2**64 - 1)))
    if wire_type == 1:
        return key + draw(st.binary(min_size=8, max_size=8))
    if wire_type == 5:
        return key + draw(st.binary(min_size=4, max_size=4))
    payload = draw(st.binary(max_size=MAX_TEXT_CHARS))
    return key + _varint(len(payload)) + payload


def message_bytes(
    descriptor: Descriptor, overrides: Overrides | None = None, strict: bool = False
) -> st.SearchStrategy[bytes]:
    """A serialized message of ``descriptor``'s type, sometimes with unknown fields after it
    (a newer client's fields must be ignored, never fatal)."""
    extra = st.lists(unknown_fields(descriptor), max_size=2).map(b"".join)
    return st.tuples(messages(descriptor, overrides, strict=strict), extra).map(
        lambda pair: pair[0].SerializeToString() + pair[1]
    )


def wire_garbage(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    """Bytes that are mostly not a valid message: random bytes, a valid message cut short or
    with one byte flipped, a length prefix that overruns, a string field with invalid UTF-8."""
    valid = message_bytes(descriptor)
    string_numbers = [f.number for f in descriptor.fields if f.type == _T.TYPE_STRING] or [1]

    @st.composite
    def damaged(draw: st.DrawFn) -> bytes:
        data = draw(valid)
        if not data:
            return draw(st.binary(min_size=1, max_size=8))
        at = draw(st.integers(0, len(data) - 1))
        if draw(st.booleans()):
            return data[:at]
        return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]

    @st.composite
    def bad_utf8(draw: st.DrawFn) -> bytes:
        number = draw(st.sampled_from(string_numbers))
        payload = draw(st.sampled_from((b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"a\x80b")))
        return _varint(number << 3 | 2) + _varint(len(payload)) + payload

    overrun = st.integers(1, 2**29 - 1).map(lambda n: _varint(n << 3 | 2) + _varint(2**31))
    return st.one_of(st.binary(max_size=256), damaged(), bad_utf8(), overrun)
