"""The staging memory of a migration target: budget, shared blocks, drops, stale requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.clock import ManualClock
from worker.kv_staging import StagingArea, StagingFull, read_staged, staged_path

BLOCK = b"x" * 1000


def test_stage_read_and_drop(tmp_path: Path) -> None:
    area = StagingArea(tmp_path / "s", budget_bytes=10_000, stale_seconds=60)
    area.stage("r1", b"\x01" * 32, BLOCK)
    area.stage("r1", b"\x02" * 32, b"y" * 500)
    assert area.blocks_of("r1") == 2 and area.bytes_of("r1") == 1500 == area.used_bytes
    view = read_staged(area.root, b"\x01" * 32)
    assert view is not None and bytes(view) == BLOCK
    assert read_staged(area.root, b"\x09" * 32) is None
    assert area.drop("r1") == 2
    assert area.used_bytes == 0 and not list(area.root.iterdir())
    assert bytes(view) == BLOCK, "a mapping stays valid after its file is deleted"
    assert area.drop("r1") == 0


def test_a_shared_block_is_staged_once_and_kept_until_its_last_request_drops(
    tmp_path: Path,
) -> None:
    area = StagingArea(tmp_path / "s", budget_bytes=10_000, stale_seconds=60)
    shared = b"\x05" * 32
    area.stage("r1", shared, BLOCK)
    assert not area.share("r2", b"\x06" * 32)
    assert area.share("r2", shared) and area.holds("r2", shared)
    area.stage("r2", shared, BLOCK)  # again: counted once
    assert area.used_bytes == len(BLOCK)
    area.drop("r1")
    assert staged_path(area.root, shared).exists()
    area.drop("r2")
    assert not staged_path(area.root, shared).exists() and area.used_bytes == 0


def test_the_budget_refuses_what_does_not_fit(tmp_path: Path) -> None:
    area = StagingArea(tmp_path / "s", budget_bytes=1500, stale_seconds=60)
    area.stage("r1", b"\x01" * 32, BLOCK)
    with pytest.raises(StagingFull, match="does not fit"):
        area.stage("r1", b"\x02" * 32, BLOCK)
    assert area.used_bytes == len(BLOCK) and area.blocks_of("r1") == 1
    with pytest.raises(ValueError):
        StagingArea(tmp_path / "t", budget_bytes=0, stale_seconds=60)


def test_stale_requests_are_dropped_and_leftovers_cleared(tmp_path: Path) -> None:
    root = tmp_path / "s"
    root.mkdir()
    (root / "leftover.blk").write_bytes(b"old")
    clock = ManualClock()
    area = StagingArea(root, budget_bytes=10_000, stale_seconds=60, clock=clock)
    assert not (root / "leftover.blk").exists()
    area.stage("abandoned", b"\x01" * 32, BLOCK)
    clock.advance(60)
    area.stage("fresh", b"\x02" * 32, BLOCK)
    assert area.blocks_of("abandoned") == 1, "not stale yet"
    clock.advance(0.001)
    area.stage("fresher", b"\x03" * 32, BLOCK)
    assert area.blocks_of("abandoned") == 0 and area.blocks_of("fresh") == 1
    area.close()
    assert not root.exists()
