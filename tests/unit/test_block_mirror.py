"""What a daemon keeps of handed-over KV for a peer move (context_daemon/block_mirror.py), the
merge of the worker's and the peer's flush reports, and the hand-off's refusals."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from common.messages import FlushReport
from context_daemon.block_mirror import BlockMirror, MirroredBlock
from context_daemon.config import DaemonConfig
from context_daemon.peer_migration import merged
from store import KVFormat, StoreConfig
from worker.config import WorkerConfig

FORMAT = KVFormat("tiny:fp32:mirror", "float32", "cpu:test", 2, 16)
RANK1 = KVFormat("tiny:fp32:mirror", "float32", "cpu:test:tp1", 2, 16, shard=":r1")


def _block(
    index: int, num_tokens: int = 0, size: int = 100, form: KVFormat = FORMAT
) -> MirroredBlock:
    return MirroredBlock(form, index, bytes([index]) * 16, num_tokens, bytes(size))


def test_a_paused_request_is_whole_only_with_every_block_and_its_tail() -> None:
    mirror = BlockMirror(10_000)
    for index in range(3):
        mirror.add("r", _block(index))
    assert mirror.blocks("r") is None, "not paused yet"
    mirror.paused("r", "", full_blocks=3, tail_tokens=5)
    assert mirror.pause_of("r", shards=1) == (3, 5)
    assert mirror.blocks("r") is None, "the tail is missing"
    mirror.add("r", _block(3, num_tokens=4))
    assert mirror.blocks("r") is None, "an earlier pause's tail does not count"
    mirror.add("r", _block(3, num_tokens=5))
    blocks = mirror.blocks("r")
    assert blocks is not None and [b.block_index for b in blocks] == [0, 1, 2, 3]


def test_a_block_missing_in_the_middle_sends_the_request_through_the_store() -> None:
    mirror = BlockMirror(10_000)
    for index in (0, 2):
        mirror.add("r", _block(index))
    mirror.paused("r", "", full_blocks=3, tail_tokens=0)
    assert mirror.blocks("r") is None


def test_every_rank_must_have_paused() -> None:
    mirror = BlockMirror(10_000)
    mirror.add("r", _block(0))
    mirror.add("r", _block(0, form=RANK1))
    mirror.paused("r", "", 1, 0)
    assert mirror.pause_of("r", shards=2) is None
    mirror.paused("r", ":r1", 1, 0)
    assert mirror.pause_of("r", shards=2) == (1, 0)
    blocks = mirror.blocks("r")
    assert blocks is not None and {b.kv_format.shard for b in blocks} == {"", ":r1"}


def test_the_least_recently_touched_request_goes_first_and_bytes_add_up() -> None:
    mirror = BlockMirror(250)
    mirror.add("old", _block(0))
    mirror.add("new", _block(0))
    mirror.add("old", _block(0))  # replaced in place: touched, no more bytes
    assert mirror.nbytes == 200
    mirror.add("third", _block(0))
    assert mirror.evicted_requests == 1
    mirror.paused("new", "", 1, 0)
    assert mirror.blocks("new") is None, "evicted: it was the least recently touched"
    mirror.drop("old")
    assert mirror.nbytes == 100
    assert BlockMirror(0).blocks("x") is None


def test_a_negative_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        BlockMirror(-1)


def _report(request_id: str, complete: bool) -> FlushReport:
    return FlushReport(request_id, complete, 0, 0, complete, 0, "w")


async def _reports(*reports: FlushReport, delay: float = 0.0) -> AsyncIterator[FlushReport]:
    for report in reports:
        await asyncio.sleep(delay)
        yield report


def test_the_first_complete_report_of_a_request_is_its_last() -> None:
    async def run() -> list[tuple[str, bool]]:
        worker = _reports(_report("a", False), _report("b", True), _report("a", True), delay=0.02)
        peer = _reports(_report("a", True), _report("b", True))
        return [(r.request_id, r.complete) async for r in merged(worker, peer)]

    seen = asyncio.run(run())
    assert seen.count(("a", True)) == 1 and seen.count(("b", True)) == 1
    assert ("a", False) not in seen[seen.index(("a", True)) :]


def test_a_hand_off_or_peer_staging_without_a_store_is_refused() -> None:
    with pytest.raises(ValueError, match="--kv-handoff-socket needs --redis-url"):
        DaemonConfig(kv_handoff_socket="/tmp/x.sock")
    with pytest.raises(ValueError, match="peer_mirror_bytes must not be negative"):
        DaemonConfig(peer_mirror_bytes=-1)
    with pytest.raises(ValueError, match="needs --redis-url"):
        WorkerConfig(model="m", kv_handoff_socket="/tmp/x.sock")
    assert DaemonConfig(
        kv_handoff_socket="/tmp/x.sock", store=StoreConfig(url="redis://127.0.0.1:1")
    ).kv_handoff_socket
