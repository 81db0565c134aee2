"""Stored blocks read straight into a file, never held whole: the KV fetcher's read.

A resume's read is big (a 4k-token context of a 135M model is ~94 MB). Read whole, its
bytes go through memory once per step: hiredis's buffer, the reply's bytes, the CRC, the
MAC, the write to the file. Beside an engine whose decode streams its weights from memory
every step, that traffic is what slows it (benchmarks.memory_interference), not the CPU
the read takes. Here each value is taken off the socket in pieces of ``READ_PIECE_BYTES``
(RedisLink.stream_values), and each piece is checked (block_codec.StreamedBlockCheck: CRC
and MAC, decode_block's verdicts) and written on while it is in the core's cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

from store.block_codec import KVBlock, KVFormat, StreamedBlockCheck
from store.block_refs import BlockRead
from store.errors import BlockRejected, RejectReason
from store.mac_keyring import MacKeyring
from store.redis_link import Command, RedisLink

READ_PIECE_BYTES = 256 * 1024
"""The piece of a value taken at a time: well inside a core's L2 cache."""


@dataclass(frozen=True)
class PayloadAt:
    """A verified block whose payload was written to a file, and where."""

    prefix_hash: bytes
    num_tokens: int
    offset: int
    length: int


def read_blocks_into(
    link: RedisLink,
    commands: Sequence[Command],
    reads: Sequence[BlockRead],
    kv_format: KVFormat,
    keyring: MacKeyring,
    out: BinaryIO,
) -> list[PayloadAt | BlockRejected]:
    """Sends ``commands`` (one per read) and writes each verified payload to ``out`` (an
    unbuffered file, from its position on, one after another in the order they arrive); a
    refused block leaves nothing there. Results in ``reads``' order. Raises as
    RedisLink.stream_values does."""
    piece = memoryview(bytearray(READ_PIECE_BYTES))
    at = out.tell()
    loaded: dict[int, PayloadAt | BlockRejected] = {}
    for index, value in link.stream_values(commands):
        read = reads[index]
        try:
            if value is None:
                raise BlockRejected(read.name, RejectReason.MISSING)
            check = StreamedBlockCheck(read.name, value.length, keyring)
            while check.header_wanted:
                check.take_header(value.read_exact(check.header_wanted))
            length = check.payload_wanted
            while check.payload_wanted:
                count = value.read_into(piece[: check.payload_wanted])
                check.update(piece[:count])
                _write_all(out, piece[:count])
            prefix_hash, num_tokens = check.finish(kv_format, *read.expected)
        except BlockRejected as rejected:
            loaded[index] = rejected
            out.seek(at)
            continue
        loaded[index] = PayloadAt(prefix_hash, num_tokens, at, length)
        at += length
    out.truncate(at)
    return [loaded[index] for index in range(len(reads))]


def write_blocks(
    blocks: Sequence[KVBlock | BlockRejected], out: BinaryIO
) -> list[PayloadAt | BlockRejected]:
    """Blocks already read whole, their payloads written to ``out`` as read_blocks_into
    writes them."""
    written: list[PayloadAt | BlockRejected] = []
    for block in blocks:
        if isinstance(block, BlockRejected):
            written.append(block)
            continue
        payload = memoryview(block.payload).cast("B")
        written.append(PayloadAt(block.prefix_hash, block.num_tokens, out.tell(), len(payload)))
        _write_all(out, payload)
    out.truncate(out.tell())
    return written


def _write_all(out: BinaryIO, data: memoryview) -> None:
    while data:
        written = out.write(data)
        data = data[written or 0 :]
