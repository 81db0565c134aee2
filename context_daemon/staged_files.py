"""The daemon's staging of pushed KV, also laid out as files for the node's worker.

A migration's target worker reads the blocks a peer pushed for it where it reads its own
prefetches: files on tmpfs named by content (store/staged_files.py), verified like a store
read, before it asks Redis for the rest (which may not answer at all). This staging writes
each block it keeps to the worker's ``--kv-peer-staging-dir`` and deletes the file with the
block (dropped, or expired with its request).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from context_daemon.peer_staging import DroppedStage, PeerStaging, StagingConfig
from store import keys
from store.block_codec import Buffer
from store.staged_files import staged_name, staged_path

log = logging.getLogger(__name__)


class FileStaging(PeerStaging):
    def __init__(
        self,
        root: Path,
        config: StagingConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(config, clock)
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.iterdir():  # an earlier process's
            with contextlib.suppress(OSError):
                leftover.unlink()
        self._sequence = 0

    def stage(self, request_id: str, key: str, data: Buffer, reserved_bytes: int) -> bool:
        kept = super().stage(request_id, key, data, reserved_bytes)
        if kept and _content_addressed(key):
            path = self._path(key)
            self._sequence += 1
            temporary = path.with_name(f".{path.name}.{os.getpid()}.{self._sequence}")
            try:
                temporary.write_bytes(memoryview(data).cast("B"))
                os.replace(temporary, path)
            except OSError as exc:
                log.warning("staging %s for the worker failed: %s", key, exc)
                with contextlib.suppress(OSError):
                    temporary.unlink()
        return kept

    def drop(self, request_id: str) -> DroppedStage:
        held = self._requests.get(request_id)
        keys_of = list(held.keys) if held is not None else []
        dropped = super().drop(request_id)
        for key in keys_of:
            if key not in self._blocks and _content_addressed(key):
                with contextlib.suppress(OSError):
                    self._path(key).unlink()
        return dropped

    def _path(self, key: str) -> Path:
        prefix_hash, shard = keys.block_key_parts(key)
        return staged_path(self.root, staged_name(prefix_hash, shard))


def _content_addressed(key: str) -> bool:
    """A block's own key (a tail pushed under its request's tail key has no file name)."""
    try:
        keys.block_key_parts(key)
    except ValueError:
        return False
    return True
