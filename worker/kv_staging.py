"""Staging memory: where a migration target keeps the KV blocks it prefetched before the pause.

A live migration moves most of a request's KV while the source still decodes (Worker.Prefetch,
called by the coordinator, once per stage); only the partial last block and the newest
tokens are left for the pause. The blocks wait here, in host memory, until the Resume that
follows the pause loads them straight into the KV cache — a memory copy instead of a read
from Redis, so the pause no longer grows with the context::

    Prefetch (gRPC process, a thread) ──GETEX──▶ Redis
        └─ StagingArea.stage(request, hash, stored bytes) ─▶ <root>/<hash>.blk (tmpfs)
    Resume ─▶ vLLM ─▶ spot connector (engine core process)
        └─ read_staged(root, hash) ─▶ verified like a Redis read ─▶ KV cache slots

Files, not an in-process dict, because vLLM's engine core (the connector) runs in another
process than the gRPC server; on tmpfs (`/dev/shm` where it exists) a file is host memory
both can map. A file holds a block exactly as the store keeps it (header + payload), named by
its content hash, so the connector verifies it as it would a Redis read and a block shared by
two requests is staged once. The staging side (this class) owns the files: it counts their
bytes against a budget, keeps a reference per request and deletes a file when no request
needs it any more (after the Resume, or when the handshake aborts); the connector only reads.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common.errors import ServiceError
from store.staged_files import staged_name, staged_path

__all__ = ["StagingArea", "StagingFull", "read_staged", "staged_name", "staged_path"]

log = logging.getLogger(__name__)

_SHARED_MEMORY = Path("/dev/shm")


class StagingFull(ServiceError, RuntimeError):
    """The staging budget (or the filesystem under it) has no room; maps to
    RESOURCE_EXHAUSTED: the target refuses the handshake."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    http_type = "rate_limit_error"


def default_staging_root(worker_id: str) -> Path:
    """A private folder on tmpfs when the machine has one, else in the temp folder."""
    base = (
        _SHARED_MEMORY if _SHARED_MEMORY.is_dir() and os.access(_SHARED_MEMORY, os.W_OK) else None
    )
    safe_id = "".join(c if c.isalnum() or c in "-_" else "_" for c in worker_id)[:64]
    return Path(tempfile.mkdtemp(prefix=f"spotinfer-staging-{safe_id}-", dir=base))


def read_staged(root: Path, prefix_hash: bytes) -> memoryview | None:
    """The stored bytes of a staged block, mapped (no copy), or None when it is not staged.
    The mapping outlives a deletion of the file; it is freed with the last view of it."""
    try:
        with staged_path(root, prefix_hash).open("rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size == 0:
                return None
            return memoryview(mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ))
    except (FileNotFoundError, ValueError, OSError):
        return None


@dataclass
class _Staged:
    request_ids: set[str] = field(default_factory=set)
    size: int = 0


@dataclass
class _RequestStage:
    hashes: list[bytes] = field(default_factory=list)
    updated_monotonic: float = 0.0


class StagingArea:
    """Thread-safe: Prefetch stages from a thread while the event loop drops.

    ``budget_bytes``: the most all staged blocks may take. ``stale_seconds``: a request whose
    blocks nobody resumed or dropped in that long (its coordinator went away mid-handshake)
    is dropped on the next stage. ``clock`` returns monotonic seconds.
    """

    def __init__(
        self,
        root: Path,
        budget_bytes: int,
        stale_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError("the staging budget must be positive")
        self.root = root
        self.budget_bytes = budget_bytes
        self._stale_seconds = stale_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._blocks: dict[bytes, _Staged] = {}
        self._requests: dict[str, _RequestStage] = {}
        self._used = 0
        self._sequence = 0
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.iterdir():  # a previous process of this worker left them
            with contextlib.suppress(OSError):
                leftover.unlink()

    @property
    def used_bytes(self) -> int:
        return self._used

    def holds(self, request_id: str, prefix_hash: bytes) -> bool:
        with self._lock:
            staged = self._blocks.get(prefix_hash)
            return staged is not None and request_id in staged.request_ids

    def share(self, request_id: str, prefix_hash: bytes) -> bool:
        """Lets ``request_id`` use a block another request staged; False when it is not here."""
        with self._lock:
            staged = self._blocks.get(prefix_hash)
            if staged is None:
                return False
            self._add_ref(request_id, prefix_hash, staged)
            return True

    def stage(self, request_id: str, prefix_hash: bytes, data: bytes | memoryview) -> None:
        """Stages one block's stored bytes for ``request_id``; raises StagingFull."""
        self._drop_stale()
        size = len(data)
        with self._lock:
            staged = self._blocks.get(prefix_hash)
            if staged is not None:
                self._add_ref(request_id, prefix_hash, staged)
                return
            if self._used + size > self.budget_bytes:
                raise StagingFull(
                    f"staging holds {self._used} of {self.budget_bytes} bytes; a block of "
                    f"{size} does not fit"
                )
            self._used += size  # reserved before the write, so two stagers cannot both fit
            self._sequence += 1
            temporary = self.root / f".{prefix_hash.hex()}.{os.getpid()}.{self._sequence}"
        try:
            temporary.write_bytes(data)
            os.replace(temporary, staged_path(self.root, prefix_hash))
        except OSError as exc:
            with self._lock:
                self._used -= size
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise StagingFull(f"staging folder {self.root}: {exc}") from exc
        with self._lock:
            staged = self._blocks.get(prefix_hash)
            if staged is None:
                staged = self._blocks[prefix_hash] = _Staged(size=size)
            else:  # staged meanwhile by another thread: count it once
                self._used -= size
            self._add_ref(request_id, prefix_hash, staged)

    def blocks_of(self, request_id: str) -> int:
        with self._lock:
            stage = self._requests.get(request_id)
            return len(stage.hashes) if stage is not None else 0

    def bytes_of(self, request_id: str) -> int:
        with self._lock:
            stage = self._requests.get(request_id)
            if stage is None:
                return 0
            return sum(self._blocks[h].size for h in stage.hashes if h in self._blocks)

    def drop(self, request_id: str) -> int:
        """Releases every block staged for ``request_id``; returns how many it had."""
        with self._lock:
            stage = self._requests.pop(request_id, None)
            if stage is None:
                return 0
            gone = []
            for prefix_hash in stage.hashes:
                staged = self._blocks.get(prefix_hash)
                if staged is None:
                    continue
                staged.request_ids.discard(request_id)
                if not staged.request_ids:
                    del self._blocks[prefix_hash]
                    self._used -= staged.size
                    gone.append(prefix_hash)
        for prefix_hash in gone:
            with contextlib.suppress(OSError):
                staged_path(self.root, prefix_hash).unlink()
        return len(stage.hashes)

    def close(self) -> None:
        """Deletes the folder and everything in it."""
        with self._lock:
            self._blocks.clear()
            self._requests.clear()
            self._used = 0
        shutil.rmtree(self.root, ignore_errors=True)

    def _add_ref(self, request_id: str, prefix_hash: bytes, staged: _Staged) -> None:
        if request_id in staged.request_ids:
            return
        staged.request_ids.add(request_id)
        stage = self._requests.setdefault(request_id, _RequestStage())
        stage.hashes.append(prefix_hash)
        stage.updated_monotonic = self._clock()

    def _drop_stale(self) -> None:
        cutoff = self._clock() - self._stale_seconds
        with self._lock:
            stale = [rid for rid, s in self._requests.items() if s.updated_monotonic < cutoff]
        for request_id in stale:
            log.warning("staged blocks of %s were never resumed; dropping them", request_id)
            self.drop(request_id)
