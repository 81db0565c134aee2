"""KV block identity (the hash chain) and the binary form a block takes in Redis.

Identity: a full block is named by a hash chain over the model and every token before and in
it, so two requests sharing a prompt prefix share the blocks of that prefix, and a reader can
recompute the name from the tokens it holds and check that the block holds the KV of exactly
those tokens::

    h_0 = blake2b(ZERO        || len(fp) || fp || token ids of block 0)
    h_i = blake2b(h_{i-1}     || len(fp) || fp || token ids of block i)

A partial last block gets the same kind of link over the tokens it holds; that hash goes into
its header for verification, but the block is stored under a per-request key (its content
changes as the request decodes, so it must not pose as a shared full block).

A block of the store is its unit of ``KVFormat.block_tokens`` tokens: the connector stores
chunks (256 tokens by default, several of the engine's own blocks) as one block each.

Stored form: ONE Redis string per block, a fixed binary header followed by the payload::

    offset  size  field
    ------  ----  ---------------------------------------------------------------
         0     4  magic b"SIKV"
         4     2  format version
         6     2  header length in bytes (fixed part + dtype + layout)
         8     4  CRC-32 of header bytes [12, header length) followed by the payload
        12     2  layer count
        14     4  block_tokens (tokens per block of the engine)
        18     4  num_tokens filled (< block_tokens only for a partial tail)
        22     8  payload length in bytes
        30    16  prefix hash (the chain hash through the block's last token)
        46    16  blake2b-128 digest of the model fingerprint
        62     1  dtype length d
        63     2  layout length l
        65     4  MAC key id (which key of the cluster keyring signed it)
        69    32  HMAC-SHA256 of bytes [12, 69) followed by bytes [101, end)
       101     d  dtype (ASCII, e.g. "float32")
     101+d     l  layout (ASCII, e.g. "cpu:blocks,kv_heads,block,2*head_dim")
   101+d+l     …  payload

The CRC is computed last and covers the MAC too.

Why one value rather than a header key and a bytes key: a single SET is atomic, so a reader
can never see a header without its bytes or the bytes of an older write with a newer header;
it is also one round trip and one key per block. The header is ~100 bytes next to payloads of
tens of KiB to MiB, so sending it with every write costs nothing measurable.

Why CRC-32 (zlib's polynomial): it catches every single-byte flip and every burst up to 32
bits, which is what storage and network corruption look like; it does not defend against a
deliberate forger: that is the MAC's job. The MAC (see mac_keyring.py) is keyed with the
cluster key, so only a holder of the key can write a block that verifies: a writer of Redis
without it can delete blocks (they are recomputed) but not plant KV. The CRC stays in front of
it because it is ~70x cheaper and tells corruption (CHECKSUM) from forgery (MAC). ISA-L's
implementation (``isal``, carry-less multiply folding) computes the very same value as
``zlib.crc32`` at tens of GB/s instead of ~4, so it is used when installed and the stored
format does not depend on which one wrote it.

Per-tenant isolation: ``chain_hash`` starts every chain at ``root_hash(tenant)``, so the same
prompt of two tenants names different blocks and one tenant can never load (or time the
presence of) another's KV. The default tenant ``""`` keeps the all-zero root.

The writer builds a block in ONE buffer (``block_buffer_bytes``): the worker copies the KV
straight from the cache into the payload part, and ``seal_block`` writes the header in front
of it and the CRC over both in place, so a block's bytes are copied once on their way to
the socket.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from store.constants import (
    BLOCK_FORMAT_VERSION,
    BLOCK_HASH_BYTES,
    BLOCK_MAGIC,
    MAC_BYTES,
    MAX_TOKEN_ID,
    TOKEN_ID_BYTES,
)
from store.errors import BlockRejected, RejectReason
from store.mac_keyring import LOOPBACK_KEYRING, MacKeyring

try:
    from isal.isal_zlib import crc32
except ImportError:  # the same checksum, only slower
    from zlib import crc32

Buffer = bytes | bytearray | memoryview
"""Anything whose bytes can be read without a copy (a payload, a stored block)."""

_CHAIN_PERSON = b"si-kv-chain"
_TENANT_PERSON = b"si-kv-tenant"
_FINGERPRINT_PERSON = b"si-model-fp"
_ROOT_HASH = bytes(BLOCK_HASH_BYTES)
# magic, version, header_len, crc, layers, block_tokens, num_tokens, payload_len,
# prefix hash, fingerprint digest, dtype len, layout len, MAC key id, MAC
_FIXED = struct.Struct(f"<4sHHIHIIQ{BLOCK_HASH_BYTES}s{BLOCK_HASH_BYTES}sBHI{MAC_BYTES}s")
_CRC_OFFSET = 8
_CRC_COVERS_FROM = 12
_MAC_OFFSET = _FIXED.size - MAC_BYTES
MAX_DTYPE_CHARS = 255
MAX_LAYOUT_CHARS = 65535 - _FIXED.size - MAX_DTYPE_CHARS


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as packed little-endian uint32, the form used in hashes and in Redis."""
    for token_id in token_ids:
        if not 0 <= token_id <= MAX_TOKEN_ID:
            raise ValueError(f"token id {token_id} outside [0, {MAX_TOKEN_ID}]")
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def unpack_token_ids(data: bytes) -> list[int]:
    if len(data) % TOKEN_ID_BYTES:
        raise ValueError(f"packed token ids of odd length {len(data)}")
    return list(struct.unpack(f"<{len(data) // TOKEN_ID_BYTES}I", data))


def fingerprint_digest(model_fingerprint: str) -> bytes:
    return hashlib.blake2b(
        model_fingerprint.encode(), digest_size=BLOCK_HASH_BYTES, person=_FINGERPRINT_PERSON
    ).digest()


def chain_hash(parent_hash: bytes, model_fingerprint: str, token_ids: Sequence[int]) -> bytes:
    """One link of the chain: the hash of a block given the hash of the block before it."""
    fingerprint = model_fingerprint.encode()
    hasher = hashlib.blake2b(digest_size=BLOCK_HASH_BYTES, person=_CHAIN_PERSON)
    hasher.update(parent_hash)
    hasher.update(struct.pack("<I", len(fingerprint)))
    hasher.update(fingerprint)
    hasher.update(pack_token_ids(token_ids))
    return hasher.digest()


def root_hash(tenant: str = "") -> bytes:
    """Where the chain of a tenant's blocks starts: all zeros for the default tenant."""
    if not tenant:
        return _ROOT_HASH
    return hashlib.blake2b(
        tenant.encode(), digest_size=BLOCK_HASH_BYTES, person=_TENANT_PERSON
    ).digest()


def block_hashes(
    model_fingerprint: str, token_ids: Sequence[int], block_tokens: int, tenant: str = ""
) -> list[bytes]:
    """Chain hashes of every FULL block of ``token_ids``; a trailing partial block is left out."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    hashes: list[bytes] = []
    parent = root_hash(tenant)
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        parent = chain_hash(parent, model_fingerprint, token_ids[start : start + block_tokens])
        hashes.append(parent)
    return hashes


def tail_hash(
    model_fingerprint: str, token_ids: Sequence[int], block_tokens: int, tenant: str = ""
) -> bytes | None:
    """Chain hash of the partial last block of ``token_ids``, or None when it ends on a boundary."""
    full = block_hashes(model_fingerprint, token_ids, block_tokens, tenant)
    tail_start = len(full) * block_tokens
    if tail_start == len(token_ids):
        return None
    parent = full[-1] if full else root_hash(tenant)
    return chain_hash(parent, model_fingerprint, token_ids[tail_start:])


@dataclass(frozen=True)
class KVFormat:
    """What a reader must agree on with the writer before KV bytes mean the same thing."""

    model_fingerprint: str
    """Identifies weights and model config; KV of another model is meaningless here."""
    dtype: str
    """Element type of the payload, e.g. ``float32``, ``bfloat16``."""
    layout: str
    """How the engine lays out one block (e.g. ``cpu:blocks,kv_heads,block,2*head_dim``)."""
    layer_count: int
    """Attention layers whose KV the payload holds."""
    block_tokens: int
    """Tokens per stored block: the connector's chunk (a multiple of the engine's block of 128
    tokens on vLLM-CPU, 16 on GPU)."""
    shard: str = ""
    """The key suffix of a sharded worker's rank (store.keys.shard_suffix): where its values
    live, not what they mean (the layout string names the rank)."""

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise ValueError("model_fingerprint must not be empty")
        if not self.dtype or len(self.dtype) > MAX_DTYPE_CHARS or not self.dtype.isascii():
            raise ValueError(f"dtype must be 1..{MAX_DTYPE_CHARS} ASCII characters")
        if not self.layout or len(self.layout) > MAX_LAYOUT_CHARS or not self.layout.isascii():
            raise ValueError(f"layout must be 1..{MAX_LAYOUT_CHARS} ASCII characters")
        if not 0 < self.layer_count < 2**16:
            raise ValueError(f"layer_count {self.layer_count} outside [1, 65535]")
        if not 0 < self.block_tokens < 2**32:
            raise ValueError(f"block_tokens {self.block_tokens} must be positive")


@dataclass(frozen=True)
class KVBlock:
    """The KV of one block: every layer's data for up to ``block_tokens`` tokens."""

    kv_format: KVFormat
    prefix_hash: bytes
    """Chain hash through the block's last token (see the module docstring)."""
    num_tokens: int
    """Tokens filled; equal to ``kv_format.block_tokens`` for a full block."""
    payload: Buffer
    """Every layer's KV of the block; a loaded block's payload is a view into what Redis
    returned (no copy)."""

    def __post_init__(self) -> None:
        if len(self.prefix_hash) != BLOCK_HASH_BYTES:
            raise ValueError(f"prefix_hash must be {BLOCK_HASH_BYTES} bytes")
        if not 0 < self.num_tokens <= self.kv_format.block_tokens:
            raise ValueError(
                f"num_tokens {self.num_tokens} outside [1, {self.kv_format.block_tokens}]"
            )

    @property
    def is_full(self) -> bool:
        return self.num_tokens == self.kv_format.block_tokens


@dataclass(frozen=True)
class EncodedBlock:
    """A block in its stored form (header + payload in one buffer), ready to send as is."""

    prefix_hash: bytes
    num_tokens: int
    is_full: bool
    data: memoryview
    """The stored bytes, format ``B``: what one SET sends without copying."""


def header_bytes(kv_format: KVFormat) -> int:
    """Length of the header of a block of ``kv_format``: where its payload starts."""
    return _FIXED.size + len(kv_format.dtype) + len(kv_format.layout)


def block_buffer_bytes(kv_format: KVFormat, payload_bytes: int) -> int:
    """Size of the one buffer that holds a block's stored form (see ``seal_block``)."""
    return header_bytes(kv_format) + payload_bytes


def _mac_parts(view: memoryview) -> tuple[memoryview, memoryview]:
    """The bytes a block's MAC covers: everything after the CRC except the MAC itself."""
    return view[_CRC_COVERS_FROM:_MAC_OFFSET], view[_FIXED.size :]


def seal_block(
    data: memoryview,
    kv_format: KVFormat,
    prefix_hash: bytes,
    num_tokens: int,
    keyring: MacKeyring = LOOPBACK_KEYRING,
) -> EncodedBlock:
    """Turn a buffer whose payload part (from ``header_bytes(kv_format)`` on) is filled into
    the stored form, in place: write the header in front of the payload, the MAC under the
    keyring's current key and the CRC over all of it.

    ``data`` must be writable and hold at least a header; nothing is copied, so the caller
    must not change the buffer after sealing it.
    """
    if len(prefix_hash) != BLOCK_HASH_BYTES:
        raise ValueError(f"prefix_hash must be {BLOCK_HASH_BYTES} bytes")
    if not 0 < num_tokens <= kv_format.block_tokens:
        raise ValueError(f"num_tokens {num_tokens} outside [1, {kv_format.block_tokens}]")
    data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    dtype = kv_format.dtype.encode()
    layout = kv_format.layout.encode()
    header_len = _FIXED.size + len(dtype) + len(layout)
    if len(data) < header_len:
        raise ValueError(f"a {len(data)}-byte buffer cannot hold a {header_len}-byte header")
    _FIXED.pack_into(
        data,
        0,
        BLOCK_MAGIC,
        BLOCK_FORMAT_VERSION,
        header_len,
        0,
        kv_format.layer_count,
        kv_format.block_tokens,
        num_tokens,
        len(data) - header_len,
        prefix_hash,
        fingerprint_digest(kv_format.model_fingerprint),
        len(dtype),
        len(layout),
        keyring.current_id,
        bytes(MAC_BYTES),
    )
    data[_FIXED.size : header_len] = dtype + layout
    _, mac = keyring.sign(_mac_parts(data))  # covers the key id, not the MAC's own bytes
    data[_MAC_OFFSET : _FIXED.size] = mac
    struct.pack_into("<I", data, _CRC_OFFSET, crc32(data[_CRC_COVERS_FROM:]))
    return EncodedBlock(
        prefix_hash=prefix_hash,
        num_tokens=num_tokens,
        is_full=num_tokens == kv_format.block_tokens,
        data=data,
    )


def encoded_block(block: KVBlock, keyring: MacKeyring = LOOPBACK_KEYRING) -> EncodedBlock:
    """The stored form of a block held as a separate payload (one copy of the payload)."""
    payload = memoryview(block.payload).cast("B")
    buffer = bytearray(block_buffer_bytes(block.kv_format, len(payload)))
    view = memoryview(buffer)
    view[header_bytes(block.kv_format) :] = payload
    return seal_block(view, block.kv_format, block.prefix_hash, block.num_tokens, keyring)


def encode_block(block: KVBlock, keyring: MacKeyring = LOOPBACK_KEYRING) -> bytes:
    """Header + payload as stored in Redis, as an immutable copy."""
    return bytes(encoded_block(block, keyring).data)


def _form_checked(
    fields: tuple[Any, ...], value_length: int, reject: Callable[..., BlockRejected]
) -> tuple[Any, ...]:
    """The fixed header's ``fields`` of a stored value of ``value_length`` bytes, once its
    form checks out: magic, version, and lengths that add up."""
    magic, version, header_len = fields[:3]
    payload_len, dtype_len, layout_len = fields[7], fields[10], fields[11]
    if magic != BLOCK_MAGIC:
        raise reject(RejectReason.MALFORMED, "bad magic")
    if version != BLOCK_FORMAT_VERSION:
        raise reject(RejectReason.VERSION, f"format {version}, expected {BLOCK_FORMAT_VERSION}")
    if (
        header_len != _FIXED.size + dtype_len + layout_len
        or value_length != header_len + payload_len
    ):
        raise reject(RejectReason.MALFORMED, "lengths do not add up")
    return fields


def _verified_fields(
    view: memoryview, reject: Callable[..., BlockRejected], keyring: MacKeyring
) -> tuple[Any, ...]:
    """The fixed header's fields of a stored block whose form, CRC and MAC check out."""
    if len(view) < _FIXED.size:
        raise reject(RejectReason.MALFORMED, f"{len(view)} bytes is shorter than a header")
    fields = _form_checked(_FIXED.unpack_from(view), len(view), reject)
    crc, mac_key_id, mac = fields[3], fields[12], fields[13]
    if crc32(view[_CRC_COVERS_FROM:]) != crc:
        raise reject(RejectReason.CHECKSUM)
    if not keyring.verify(mac_key_id, mac, _mac_parts(view)):
        raise reject(RejectReason.MAC, f"key id {mac_key_id}")
    return tuple(fields)


def decode_block(
    block_name: str,
    data: Buffer | None,
    expected: KVFormat,
    expected_prefix_hash: bytes,
    expected_num_tokens: int,
    keyring: MacKeyring = LOOPBACK_KEYRING,
) -> KVBlock:
    """Parse and verify a stored block; raise BlockRejected unless every check passes.

    ``expected_prefix_hash`` is computed by the reader from the tokens it holds, so a block
    that passes holds the KV of exactly those tokens, written by the same model, in the same
    dtype and layout, unchanged since it was written, by a holder of a key of ``keyring``.
    """

    def reject(reason: RejectReason, detail: str = "") -> BlockRejected:
        return BlockRejected(block_name, reason, detail)

    if data is None:
        raise reject(RejectReason.MISSING)
    view = memoryview(data).cast("B")
    fields = _verified_fields(view, reject, keyring)
    header_len = fields[2]
    _check_reader_format(
        view[:header_len], fields, expected, expected_prefix_hash, expected_num_tokens, reject
    )
    return KVBlock(
        kv_format=expected,
        prefix_hash=fields[8],
        num_tokens=fields[6],
        payload=view[header_len:],
    )


def _check_reader_format(
    header: memoryview,
    fields: tuple[Any, ...],
    expected: KVFormat,
    expected_prefix_hash: bytes,
    expected_num_tokens: int,
    reject: Callable[..., BlockRejected],
) -> None:
    """The checks of a verified header against what its reader wants: model, dtype, layout,
    geometry and the tokens' chain hash."""
    layer_count, block_tokens, num_tokens = fields[4:7]
    prefix_hash, fp_digest, dtype_len = fields[8:11]
    if fp_digest != fingerprint_digest(expected.model_fingerprint):
        raise reject(RejectReason.FINGERPRINT)
    dtype = bytes(header[_FIXED.size : _FIXED.size + dtype_len]).decode("ascii", "replace")
    if dtype != expected.dtype:
        raise reject(RejectReason.DTYPE, f"{dtype!r}, expected {expected.dtype!r}")
    layout = bytes(header[_FIXED.size + dtype_len :]).decode("ascii", "replace")
    if layout != expected.layout:
        raise reject(RejectReason.LAYOUT, f"{layout!r}, expected {expected.layout!r}")
    if (layer_count, block_tokens, num_tokens) != (
        expected.layer_count,
        expected.block_tokens,
        expected_num_tokens,
    ):
        raise reject(
            RejectReason.GEOMETRY,
            f"layers/block/filled {layer_count}/{block_tokens}/{num_tokens}, expected "
            f"{expected.layer_count}/{expected.block_tokens}/{expected_num_tokens}",
        )
    if prefix_hash != expected_prefix_hash:
        raise reject(RejectReason.PREFIX_HASH)


class StreamedBlockCheck:
    """decode_block's checks, in decode_block's order and with its verdicts, over a stored
    block that arrives in pieces and is never held whole (the KV fetcher: each piece is
    checked while it is in the CPU's cache and written on, instead of a whole reply going
    through memory once per check)::

        check = StreamedBlockCheck(name, value_length, keyring)
        check.take_header(first check.header_wanted bytes)   # again while header_wanted
        for piece in payload: check.update(piece)            # check.payload_wanted bytes
        prefix_hash, num_tokens = check.finish(expected, prefix_hash, num_tokens)

    Every step raises BlockRejected as decode_block would for the same bytes; the form's
    checks (magic, version, lengths) come at once, CRC and MAC and the reader's at finish.
    """

    def __init__(
        self, block_name: str, value_length: int, keyring: MacKeyring = LOOPBACK_KEYRING
    ) -> None:
        self._name = block_name
        self._length = value_length
        self._keyring = keyring
        self._header = bytearray()
        self._fields: tuple[Any, ...] | None = None
        self._header_len = _FIXED.size
        self._crc = 0
        self._mac: Any = None
        self._mac_key_id = 0
        self._received = 0
        if value_length < _FIXED.size:
            raise self._reject(
                RejectReason.MALFORMED, f"{value_length} bytes is shorter than a header"
            )

    @property
    def header_wanted(self) -> int:
        """Header bytes still to take (0: the payload follows)."""
        return self._header_len - len(self._header)

    @property
    def payload_wanted(self) -> int:
        return self._length - self._header_len - self._received

    def take_header(self, data: Buffer) -> None:
        piece = memoryview(data).cast("B")
        if len(piece) > self.header_wanted:
            raise ValueError(f"{len(piece)} header bytes, {self.header_wanted} wanted")
        self._header += piece
        if self._fields is None and len(self._header) == _FIXED.size:
            self._fields = _form_checked(
                _FIXED.unpack_from(self._header), self._length, self._reject
            )
            self._header_len, self._mac_key_id = self._fields[2], self._fields[12]
        if self._fields is not None and not self.header_wanted:
            header = memoryview(self._header)
            self._crc = crc32(header[_CRC_COVERS_FROM:])
            self._mac = self._keyring.mac_state(self._mac_key_id)
            if self._mac is not None:
                for part in _mac_parts(header):
                    self._mac.update(part)

    def update(self, data: Buffer) -> None:
        """One piece of the payload, in order."""
        piece = memoryview(data).cast("B")
        if self.header_wanted or len(piece) > self.payload_wanted:
            raise ValueError(f"{len(piece)} payload bytes, {self.payload_wanted} wanted")
        self._crc = crc32(piece, self._crc)
        if self._mac is not None:
            self._mac.update(piece)
        self._received += len(piece)

    def finish(
        self, expected: KVFormat, expected_prefix_hash: bytes, expected_num_tokens: int
    ) -> tuple[bytes, int]:
        """The block's prefix hash and filled tokens once every byte checked out."""
        if self.header_wanted or self.payload_wanted or self._fields is None:
            raise ValueError("finish before the whole block was taken")
        fields = self._fields
        if self._crc != fields[3]:
            raise self._reject(RejectReason.CHECKSUM)
        if self._mac is None or not hmac.compare_digest(self._mac.digest(), fields[-1]):
            raise self._reject(RejectReason.MAC, f"key id {self._mac_key_id}")
        _check_reader_format(
            memoryview(self._header),
            fields,
            expected,
            expected_prefix_hash,
            expected_num_tokens,
            self._reject,
        )
        return bytes(fields[8]), int(fields[6])

    def _reject(self, reason: RejectReason, detail: str = "") -> BlockRejected:
        return BlockRejected(self._name, reason, detail)


@dataclass(frozen=True)
class SealedHeader:
    """What a block whose CRC and MAC verified says about itself: a holder of the cluster key
    wrote it and it is unchanged since. Whether it is the KV a reader wants (model, dtype,
    layout, tokens) is for that reader's `decode_block`."""

    prefix_hash: bytes
    num_tokens: int
    block_tokens: int

    @property
    def is_full(self) -> bool:
        return self.num_tokens == self.block_tokens


def verify_sealed(
    block_name: str, data: Buffer, keyring: MacKeyring = LOOPBACK_KEYRING
) -> SealedHeader:
    """The checks that need no reader's format (form, CRC, MAC): what a holder of a copy that
    some reader verifies later (a migration target's staging) checks on arrival. Raises
    BlockRejected (MALFORMED, VERSION, CHECKSUM or MAC)."""

    def reject(reason: RejectReason, detail: str = "") -> BlockRejected:
        return BlockRejected(block_name, reason, detail)

    fields = _verified_fields(memoryview(data).cast("B"), reject, keyring)
    block_tokens, num_tokens, prefix_hash = fields[5], fields[6], fields[8]
    return SealedHeader(bytes(prefix_hash), int(num_tokens), int(block_tokens))


HEADER_FIXED_BYTES = _FIXED.size


@dataclass(frozen=True)
class BlockSummary:
    """What a stored block's header claims, unverified: enough to tell whether the block that
    a flush should have written is there, without fetching (or knowing the format of) its
    payload. A reader that loads the block still verifies everything with ``decode_block``."""

    num_tokens: int
    prefix_hash: bytes


def read_summary(data: bytes | None) -> BlockSummary | None:
    """The summary of a header (at least HEADER_FIXED_BYTES of it); None if it is not one."""
    if data is None or len(data) < _FIXED.size:
        return None
    fields = _FIXED.unpack_from(data)
    magic, version, num_tokens, prefix_hash = fields[0], fields[1], fields[6], fields[8]
    if magic != BLOCK_MAGIC or version != BLOCK_FORMAT_VERSION:
        return None
    return BlockSummary(num_tokens=int(num_tokens), prefix_hash=bytes(prefix_hash))
