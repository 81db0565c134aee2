"""A stored block checked piece by piece (StreamedBlockCheck) gets decode_block's verdict on
the same bytes: the same fields when it passes, the same reason when it does not, however the
bytes are cut into pieces."""

from __future__ import annotations

import struct
from dataclasses import replace
from zlib import crc32

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store import BlockRejected, KVBlock, KVFormat, RejectReason, block_hashes
from store.block_codec import StreamedBlockCheck, decode_block, encode_block
from store.mac_keyring import LOOPBACK_KEYRING, MacKeyring, parse_keyring
from tests.context_daemon.test_block_codec import FORMAT

PREFIX = block_hashes("tiny:1", [1, 2, 3, 4], 4)[0]
KEYRING = parse_keyring("1:" + "ab" * 32)


def _stored(num_tokens: int = 4, payload: bytes = bytes(range(256)) * 3) -> bytes:
    return encode_block(KVBlock(FORMAT, PREFIX, num_tokens, payload), KEYRING)


def _decoded(data: bytes, expected: KVFormat, num_tokens: int, keyring: MacKeyring) -> object:
    try:
        block = decode_block("b", data, expected, PREFIX, num_tokens, keyring)
    except BlockRejected as rejected:
        return rejected.reason, rejected.detail
    return bytes(block.prefix_hash), block.num_tokens, bytes(block.payload)


def _streamed(
    data: bytes, cuts: list[int], expected: KVFormat, num_tokens: int, keyring: MacKeyring
) -> object:
    """The block fed in pieces cut at ``cuts`` (fractions of what is wanted next)."""
    view = memoryview(data)
    at = 0
    payload = bytearray()
    pieces = iter(cuts)
    try:
        check = StreamedBlockCheck("b", len(data), keyring)
        while check.header_wanted:
            size = max(1, next(pieces, check.header_wanted) % (check.header_wanted + 1))
            check.take_header(view[at : at + size])
            at += size
        while check.payload_wanted:
            size = max(1, next(pieces, check.payload_wanted) % (check.payload_wanted + 1))
            check.update(view[at : at + size])
            payload += view[at : at + size]
            at += size
        prefix_hash, filled = check.finish(expected, PREFIX, num_tokens)
    except BlockRejected as rejected:
        return rejected.reason, rejected.detail
    return prefix_hash, filled, bytes(payload)


def _same_verdict(
    data: bytes,
    cuts: list[int],
    expected: KVFormat = FORMAT,
    num_tokens: int = 4,
    keyring: MacKeyring = KEYRING,
) -> object:
    want = _decoded(data, expected, num_tokens, keyring)
    assert _streamed(data, cuts, expected, num_tokens, keyring) == want
    return want


CUTS = st.lists(st.integers(min_value=1, max_value=2000), max_size=12)


@settings(max_examples=150, deadline=None)
@given(cuts=CUTS)
def test_an_intact_block_passes_with_its_payload_in_any_pieces(cuts: list[int]) -> None:
    verdict = _same_verdict(_stored(), cuts)
    assert verdict == (PREFIX, 4, bytes(range(256)) * 3)


@settings(max_examples=300, deadline=None)
@given(offset=st.integers(min_value=0, max_value=len(_stored()) - 1), cuts=CUTS)
def test_a_flipped_byte_anywhere_gets_decode_blocks_reason(offset: int, cuts: list[int]) -> None:
    flipped = bytearray(_stored())
    flipped[offset] ^= 0x40
    verdict = _same_verdict(bytes(flipped), cuts)
    assert isinstance(verdict, tuple) and isinstance(verdict[0], RejectReason)


@settings(max_examples=100, deadline=None)
@given(length=st.integers(min_value=0, max_value=len(_stored()) - 1), cuts=CUTS)
def test_a_cut_short_block_is_malformed(length: int, cuts: list[int]) -> None:
    verdict = _same_verdict(_stored()[:length], cuts)
    assert verdict[0] is RejectReason.MALFORMED  # type: ignore[index]


def test_the_readers_checks_and_the_keyring_come_out_the_same() -> None:
    data = _stored()
    assert _same_verdict(data, [], replace(FORMAT, dtype="bfloat16"))[0] is RejectReason.DTYPE  # type: ignore[index]
    assert _same_verdict(data, [], replace(FORMAT, layout="x"))[0] is RejectReason.LAYOUT  # type: ignore[index]
    assert _same_verdict(data, [], replace(FORMAT, model_fingerprint="m"))[0] is (  # type: ignore[index]
        RejectReason.FINGERPRINT
    )
    assert _same_verdict(data, [], FORMAT, num_tokens=3)[0] is RejectReason.GEOMETRY  # type: ignore[index]
    assert _same_verdict(data, [7], keyring=LOOPBACK_KEYRING)[0] is RejectReason.MAC  # type: ignore[index]
    other_key = parse_keyring("1:" + "cd" * 32)
    assert _same_verdict(data, [3, 5], keyring=other_key)[0] is RejectReason.MAC  # type: ignore[index]
    partial = _stored(num_tokens=2, payload=bytes(512))
    assert _same_verdict(partial, [100], FORMAT, num_tokens=2) == (PREFIX, 2, bytes(512))


def test_a_forged_block_with_a_good_crc_fails_its_mac() -> None:
    forged = bytearray(_stored())
    forged[-1] ^= 0x01
    struct.pack_into("<I", forged, 8, crc32(bytes(forged[12:])))
    assert _same_verdict(bytes(forged), [50, 50])[0] is RejectReason.MAC  # type: ignore[index]


def test_bytes_beyond_what_is_wanted_are_a_usage_error_not_a_verdict() -> None:
    data = _stored()
    check = StreamedBlockCheck("b", len(data), KEYRING)
    with pytest.raises(ValueError, match="wanted"):
        check.take_header(data[: check.header_wanted + 1])
    check.take_header(data[: check.header_wanted])
    with pytest.raises(ValueError, match="wanted"):
        check.update(data[: check.payload_wanted + 1])
    with pytest.raises(ValueError, match="before the whole block"):
        check.finish(FORMAT, PREFIX, 4)
