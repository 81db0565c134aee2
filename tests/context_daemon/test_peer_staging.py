"""The target's staging area and the chunking of blocks, without a server: room, sharing,
expiry, and chunks that do not continue their block."""

from __future__ import annotations

import pytest

from context_daemon.block_chunks import Block, BlockChunk, ChunkAssembler, split_block
from context_daemon.peer_errors import BadChunk, StagingFull
from context_daemon.peer_staging import PeerStaging, StagingConfig


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def staging(max_bytes: int = 100, ttl_seconds: float = 10.0) -> tuple[PeerStaging, Clock]:
    clock = Clock()
    return PeerStaging(StagingConfig(max_bytes, ttl_seconds), clock), clock


def stage(area: PeerStaging, request_id: str, key: str, size: int) -> bool:
    area.reserve(size, key)
    return area.stage(request_id, key, bytes(size), size)


def test_a_block_shared_by_two_requests_is_held_once_and_freed_with_the_last() -> None:
    area, _ = staging()
    assert stage(area, "a", "k1", 30) is True
    assert stage(area, "b", "k1", 30) is False  # the same content address: a reference
    assert stage(area, "a", "k2", 20) is True
    assert area.stats().staged_bytes == 50
    dropped = area.drop("a")
    assert (dropped.blocks, dropped.bytes) == (2, 20)
    assert [key for key, _ in area.fetch("b")] == ["k1"]
    assert area.drop("b").bytes == 30
    assert area.stats().staged_bytes == 0 and area.stats().staged_blocks == 0


def test_room_counts_what_is_staged_and_what_is_arriving() -> None:
    area, _ = staging(max_bytes=100)
    stage(area, "a", "k1", 60)
    area.reserve(30, "k2")
    with pytest.raises(StagingFull, match="staging is full: k3 needs 20 bytes"):
        area.reserve(20, "k3")
    area.release(30)
    area.reserve(40, "k3")  # the released room is free again
    assert area.stats().reserved_bytes == 40


def test_a_request_nobody_reads_or_drops_expires() -> None:
    area, clock = staging(ttl_seconds=10.0)
    stage(area, "a", "k1", 10)
    stage(area, "b", "k2", 10)
    clock.now += 6
    assert area.fetch("b")  # a read restarts b's time
    clock.now += 6
    assert area.expire() == 1
    assert not area.holds("a", "k1") and area.holds("b", "k2")
    assert area.stats().expired_requests == 1


def test_fetch_gives_the_named_keys_in_order_and_skips_the_others() -> None:
    area, _ = staging()
    for key in ("k1", "k2", "k3"):
        stage(area, "a", key, 5)
    stage(area, "b", "k4", 5)
    assert [key for key, _ in area.fetch("a", ["k3", "k4", "k1"])] == ["k3", "k1"]


def test_config_refuses_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        StagingConfig(max_bytes=0)
    with pytest.raises(ValueError, match="ttl_seconds"):
        StagingConfig(ttl_seconds=0)


def test_a_block_in_chunks_comes_back_whole() -> None:
    data = bytes(range(256)) * 40
    admitted: list[int] = []
    assembler = ChunkAssembler(1 << 20, lambda chunk: admitted.append(chunk.block_bytes))
    chunks = list(split_block(Block("r", "k", data), 1000))
    assert len(chunks) == 11 and chunks[-1].last and not chunks[0].last
    blocks = [assembler.add(chunk) for chunk in chunks]
    assert blocks[:-1] == [None] * 10
    assert blocks[-1] is not None and bytes(blocks[-1].data) == data
    assert admitted == [len(data)]
    assembler.finish()


def test_a_small_block_is_one_chunk_of_its_own_bytes() -> None:
    data = b"x" * 100
    (chunk,) = split_block(Block("r", "k", data), 1000)
    assert chunk.data is data and chunk.last


def chunk(
    offset: int, size: int, total: int = 30, key: str = "k", last: bool = False
) -> BlockChunk:
    return BlockChunk("r", key, offset, total, b"x" * size, last)


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([chunk(5, 10)], "starts at offset 5"),
        ([chunk(0, 10), chunk(20, 10, last=True)], "offset 10 of this block was due"),
        ([chunk(0, 10), chunk(10, 10, key="other")], "a chunk of other"),
        ([chunk(0, 10), chunk(10, 25, last=True)], "does not fit a block of 30"),
        ([chunk(0, 30)], "last=False"),
        ([chunk(0, 0, total=0)], "claims 0 bytes"),
    ],
)
def test_chunks_that_do_not_continue_their_block_are_refused(
    chunks: list[BlockChunk], message: str
) -> None:
    assembler = ChunkAssembler(1 << 20)
    with pytest.raises(BadChunk, match=message):
        for each in chunks:
            assembler.add(each)


def test_a_stream_that_ends_inside_a_block_is_refused() -> None:
    assembler = ChunkAssembler(1 << 20)
    assembler.add(chunk(0, 10))
    with pytest.raises(BadChunk, match="ended inside block k"):
        assembler.finish()
