"""A KV block on the peer wire: cut into chunks that fit a gRPC message, and put back together.

    block (stored form, e.g. 2.9 MB)     chunks (<= chunk_bytes each, in order)
    ┌──────────────────────────────┐     offset 0        block_bytes N
    │ header │ payload ...         │ ──▶ offset c        block_bytes N
    └──────────────────────────────┘     offset 2c  last block_bytes N

Every chunk names its request, the block's store key, where its bytes start and the whole
block's length, so the receiver can reserve room for the block before its bytes arrive and
check that nothing is missing, repeated or out of order. A stream carries its blocks one after
the other: a block's chunks are never interleaved with another block's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from context_daemon.peer_errors import BadChunk
from store.block_codec import Buffer


@dataclass(frozen=True)
class BlockChunk:
    """One piece of a block (the `KvBlockChunk` message)."""

    request_id: str
    key: str
    offset: int
    block_bytes: int
    data: Buffer
    last: bool


@dataclass(frozen=True)
class Block:
    """A whole block: whom it is for, its store key and its stored bytes."""

    request_id: str
    key: str
    data: Buffer


def split_block(block: Block, chunk_bytes: int) -> Iterator[BlockChunk]:
    """The chunks of ``block``, none longer than ``chunk_bytes`` (views, never copies)."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    view = memoryview(block.data).cast("B")
    total = len(view)
    if total == 0:
        raise ValueError(f"block {block.key} is empty")
    if total <= chunk_bytes:  # one chunk: the block's own bytes (bytes then need no copy)
        yield BlockChunk(block.request_id, block.key, 0, total, block.data, True)
        return
    for offset in range(0, total, chunk_bytes):
        end = min(total, offset + chunk_bytes)
        yield BlockChunk(block.request_id, block.key, offset, total, view[offset:end], end == total)


class ChunkAssembler:
    """Puts one stream's chunks back together, one block at a time.

    ``admit(block_bytes)`` is called at a block's first chunk, before any of its bytes are
    kept (the staging area reserves room there, or raises); ``max_block_bytes`` bounds what
    one block may claim. Raises BadChunk for chunks that do not continue the block in order.
    """

    def __init__(
        self, max_block_bytes: int, admit: Callable[[BlockChunk], None] = lambda chunk: None
    ) -> None:
        self._max_block_bytes = max_block_bytes
        self._admit = admit
        self._first: BlockChunk | None = None
        self._buffer = bytearray()
        self._received = 0

    @property
    def open_block(self) -> BlockChunk | None:
        """The first chunk of the block being received (None between blocks)."""
        return self._first

    def add(self, chunk: BlockChunk) -> Block | None:
        """Takes the next chunk; returns the block it completes, else None."""
        first = self._first
        if first is None:
            self._start(chunk)
            first = chunk
        elif (chunk.request_id, chunk.key, chunk.block_bytes) != (
            first.request_id,
            first.key,
            first.block_bytes,
        ) or chunk.offset != self._received:
            raise BadChunk(
                f"block {first.key}: a chunk of {chunk.key} at offset {chunk.offset} came "
                f"where offset {self._received} of this block was due"
            )
        size = len(chunk.data)
        end = self._received + size
        if end > first.block_bytes or chunk.last != (end == first.block_bytes) or not size:
            raise BadChunk(
                f"block {first.key}: a chunk of {size} bytes at offset {chunk.offset} "
                f"(last={chunk.last}) does not fit a block of {first.block_bytes} bytes"
            )
        if chunk.last and chunk.offset == 0:  # one chunk: the message's bytes are the block
            self._first = None
            return Block(chunk.request_id, chunk.key, chunk.data)
        self._buffer[self._received : end] = chunk.data
        self._received = end
        if not chunk.last:
            return None
        block = Block(first.request_id, first.key, self._buffer)
        self._first, self._buffer, self._received = None, bytearray(), 0
        return block

    def _start(self, chunk: BlockChunk) -> None:
        if not chunk.request_id or not chunk.key:
            raise BadChunk("a chunk must name its request and its block's key")
        if chunk.offset != 0:
            raise BadChunk(f"block {chunk.key} starts at offset {chunk.offset}, not 0")
        if not chunk.block_bytes:
            raise BadChunk(f"block {chunk.key} claims 0 bytes")
        self._admit(chunk)  # may refuse a block too big for where it goes, in its own words
        if chunk.block_bytes > self._max_block_bytes:
            raise BadChunk(
                f"block {chunk.key} claims {chunk.block_bytes} bytes; a block has at most "
                f"{self._max_block_bytes}"
            )
        self._first = chunk
        if not chunk.last:
            self._buffer = bytearray(chunk.block_bytes)
            self._received = 0

    def finish(self) -> None:
        """The stream ended: raises BadChunk if it ended inside a block."""
        if self._first is not None:
            raise BadChunk(
                f"the stream ended inside block {self._first.key} "
                f"({self._received} of {self._first.block_bytes} bytes)"
            )
