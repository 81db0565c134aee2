"""Where a worker finds KV staged for it on its host: one file per block in its stored form,
named by content (and a sharded worker's rank), so a reader verifies it as it would a Redis
read. The worker's own prefetches (worker/kv_staging.py) and its daemon's peer pushes
(context_daemon/staged_files.py) each write a folder of these."""

from __future__ import annotations

from pathlib import Path

SUFFIX = ".blk"


def staged_name(prefix_hash: bytes, shard: str = "") -> bytes:
    """What a staged value is named by: its block's hash, and a sharded worker's rank
    (store.keys.shard_suffix) after it, so every rank's shard is a file of its own."""
    return prefix_hash + shard.encode()


def staged_path(root: Path, name: bytes) -> Path:
    return root / f"{name.hex()}{SUFFIX}"
