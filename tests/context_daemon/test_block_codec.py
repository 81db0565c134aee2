"""Block identity and the stored form, without Redis: the checks a loaded block must pass."""

from __future__ import annotations

import struct
from zlib import crc32

import pytest

from store import BlockRejected, KVBlock, KVFormat, RejectReason, block_hashes
from store.block_codec import chain_hash, decode_block, encode_block, tail_hash
from store.mac_keyring import parse_keyring

FORMAT = KVFormat(
    model_fingerprint="tiny:1",
    dtype="float32",
    layout="cpu:blocks,kv_heads,block,2*head_dim",
    layer_count=2,
    block_tokens=4,
)


def test_shared_prefixes_share_block_hashes_and_diverge_after() -> None:
    a = block_hashes("tiny:1", [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_hashes("tiny:1", [1, 2, 3, 4, 5, 6, 7, 0, 9], 4)
    assert len(a) == 2  # the ninth token is a partial block, not a full one
    assert a[0] == b[0] and a[1] != b[1]
    # the same tokens under another model, or at another position, are other blocks
    assert block_hashes("tiny:2", [1, 2, 3, 4], 4)[0] != a[0]
    assert (
        block_hashes("tiny:1", [5, 6, 7, 8, 5, 6, 7, 8], 4)[1]
        != (block_hashes("tiny:1", [5, 6, 7, 8], 4)[0])
    )


def test_tail_hash_continues_the_chain() -> None:
    full = block_hashes("tiny:1", [1, 2, 3, 4], 4)
    assert tail_hash("tiny:1", [1, 2, 3, 4, 5], 4) == chain_hash(full[0], "tiny:1", [5])
    assert tail_hash("tiny:1", [1, 2, 3, 4], 4) is None


def encoded(num_tokens: int = 4, payload: bytes = bytes(range(256)) * 4) -> tuple[bytes, bytes]:
    prefix = block_hashes("tiny:1", [1, 2, 3, 4], 4)[0]
    block = KVBlock(FORMAT, prefix, num_tokens, payload)
    return encode_block(block), prefix


def test_round_trip() -> None:
    data, prefix = encoded()
    block = decode_block("b", data, FORMAT, prefix, 4)
    assert block.payload == bytes(range(256)) * 4 and block.is_full


@pytest.mark.parametrize("offset", [12, 20, 40, 70, -1, -500])
def test_any_flipped_byte_after_the_lengths_is_a_checksum_failure(offset: int) -> None:
    data, prefix = encoded()
    flipped = bytearray(data)
    flipped[offset] ^= 0x01
    with pytest.raises(BlockRejected) as rejected:
        decode_block("b", bytes(flipped), FORMAT, prefix, 4)
    assert rejected.value.reason is RejectReason.CHECKSUM


@pytest.mark.parametrize(
    ("expected", "reason"),
    [
        (KVFormat("tiny:2", "float32", FORMAT.layout, 2, 4), RejectReason.FINGERPRINT),
        (KVFormat("tiny:1", "bfloat16", FORMAT.layout, 2, 4), RejectReason.DTYPE),
        (KVFormat("tiny:1", "float32", "gpu:2,blocks,block,heads,dim", 2, 4), RejectReason.LAYOUT),
        (KVFormat("tiny:1", "float32", FORMAT.layout, 3, 4), RejectReason.GEOMETRY),
    ],
)
def test_format_mismatches_are_rejected(expected: KVFormat, reason: RejectReason) -> None:
    data, prefix = encoded()
    with pytest.raises(BlockRejected) as rejected:
        decode_block("b", data, expected, prefix, 4)
    assert rejected.value.reason is reason


def test_wrong_tokens_truncation_garbage_and_absence_are_rejected() -> None:
    data, prefix = encoded()
    other = block_hashes("tiny:1", [1, 2, 3, 5], 4)[0]
    cases = [
        (data, other, 4, RejectReason.PREFIX_HASH),
        (data, prefix, 3, RejectReason.GEOMETRY),
        (data[:-1], prefix, 4, RejectReason.MALFORMED),
        (b"not a block", prefix, 4, RejectReason.MALFORMED),
        (b"XXXX" + data[4:], prefix, 4, RejectReason.MALFORMED),
        (data[:4] + b"\x09\x00" + data[6:], prefix, 4, RejectReason.VERSION),
        (None, prefix, 4, RejectReason.MISSING),
    ]
    for stored, expected_hash, num_tokens, reason in cases:
        with pytest.raises(BlockRejected) as rejected:
            decode_block("b", stored, FORMAT, expected_hash, num_tokens)
        assert rejected.value.reason is reason


def test_invalid_formats_and_blocks_are_refused_at_construction() -> None:
    with pytest.raises(ValueError):
        KVFormat("", "float32", "x", 1, 4)
    with pytest.raises(ValueError):
        KVFormat("m", "float32", "x", 0, 4)
    with pytest.raises(ValueError):
        KVBlock(FORMAT, b"short", 4, b"")
    with pytest.raises(ValueError):
        KVBlock(FORMAT, bytes(16), 5, b"")
    with pytest.raises(ValueError):
        block_hashes("m", [2**32], 1)


KEYRING = parse_keyring("1:" + "11" * 32 + "\n")


def forged(data: bytes, offset: int) -> bytes:
    """``data`` with one payload byte changed and its CRC recomputed: passes the checksum."""
    changed = bytearray(data)
    changed[offset] ^= 0x01
    struct.pack_into("<I", changed, 8, crc32(bytes(changed[12:])))
    return bytes(changed)


def test_a_block_altered_with_its_crc_fixed_fails_its_mac() -> None:
    prefix = block_hashes("tiny:1", [1, 2, 3, 4], 4)[0]
    data = encode_block(KVBlock(FORMAT, prefix, 4, bytes(1024)), KEYRING)
    assert decode_block("b", data, FORMAT, prefix, 4, KEYRING).payload == bytes(1024)
    with pytest.raises(BlockRejected) as rejected:
        decode_block("b", forged(data, -1), FORMAT, prefix, 4, KEYRING)
    assert rejected.value.reason is RejectReason.MAC


def test_a_block_under_another_key_fails_and_a_rotated_key_still_verifies() -> None:
    prefix = block_hashes("tiny:1", [1, 2, 3, 4], 4)[0]
    data = encode_block(KVBlock(FORMAT, prefix, 4, bytes(64)), KEYRING)
    with pytest.raises(BlockRejected) as rejected:
        decode_block("b", data, FORMAT, prefix, 4)  # the loopback key
    assert rejected.value.reason is RejectReason.MAC
    rotated = parse_keyring("1:" + "11" * 32 + "\n2:" + "22" * 32 + "\n")
    decode_block("b", data, FORMAT, prefix, 4, rotated)
    newer = encode_block(KVBlock(FORMAT, prefix, 4, bytes(64)), rotated)
    with pytest.raises(BlockRejected):
        decode_block("b", newer, FORMAT, prefix, 4, KEYRING)


def test_tenants_name_the_same_tokens_differently() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    default = block_hashes("tiny:1", tokens, 4)
    assert default == block_hashes("tiny:1", tokens, 4, tenant="")
    a = block_hashes("tiny:1", tokens, 4, tenant="a")
    b = block_hashes("tiny:1", tokens, 4, tenant="b")
    assert len({default[0], a[0], b[0]}) == 3 and len({default[1], a[1], b[1]}) == 3
    assert tail_hash("tiny:1", tokens, 4, "a") != tail_hash("tiny:1", tokens, 4, "b")
