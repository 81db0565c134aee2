"""Keeps the daemon's buffers of megabytes on the heap, where the next block reuses them.

A KV block crosses the daemon in buffers of megabytes: a gRPC message, its bytes field, the
staged copy. glibc serves an allocation above its mmap threshold (128 KiB at first, adapting)
with a fresh mmap and unmaps it at free, so every such buffer is faulted in page by page
anew; with the threshold at glibc's most (32 MiB) and freed heap kept, blocks reuse memory
instead. On the 2-core test machine a peer push over loopback went from ~210 to ~360 MB/s
on one stream with it (source and target both tuned), in a side measurement with the same
blocks as benchmarks/peer_migration.py. The price: up to MALLOC_TRIM_THRESHOLD_BYTES of freed
memory stays with the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from context_daemon.constants import MALLOC_MMAP_THRESHOLD_BYTES, MALLOC_TRIM_THRESHOLD_BYTES

log = logging.getLogger(__name__)

# <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_large_buffers(
    mmap_threshold_bytes: int = MALLOC_MMAP_THRESHOLD_BYTES,
    trim_threshold_bytes: int = MALLOC_TRIM_THRESHOLD_BYTES,
) -> bool:
    """Sets glibc's thresholds for this process (call it early); False where the C library
    has no mallopt (not glibc) or refuses a value: nothing changes then."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None)
    if mallopt is None:
        return False
    done = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes)
    )
    if not done:
        log.warning("malloc thresholds not set: big buffers are mapped afresh for each block")
    return done
