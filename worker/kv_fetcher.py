"""Reading a resume's stored KV in a process of its own, so that the engine does not pay for it.

A resume's read is big (a 4k-token context of a 135M model is ~94 MB) and, in the engine's
process, slow for everyone else: parsing Redis's replies and checking CRCs and MACs take the
interpreter lock and a core while the engine thread steps the other sequences. The fetcher
is a child process at the lowest CPU priority that does the whole read — one pipelined round
trip, every check of store.block_codec — and writes the verified payloads into one file of
shared memory, which the engine process maps (no copy) and the loader scatters from::

    lookup thread ──(reads, format)──▶ fetcher process (nice 19): RedisStore.get_blocks_into
         ▲                                  │ payloads ─▶ /dev/shm/spotinfer-kv-* (one file)
         └──── blocks: views of the mapping ◀┘ per block: its header fields, or why refused

Its priority keeps it off the engine's core, not out of the engine's way: the engine's
decode streams the weights from memory every step, and bytes moved through memory on the
other core compete with it for bandwidth (benchmarks.memory_interference: a 94 MB copy loop
beside a 270 MB bf16 matrix-vector product slowed it 1.03-1.48x on the same 2-core VM, with
what else shared the host's memory). So the read moves each byte through memory as few
times as it can: each value goes from the socket to the file in pieces that stay in the
fetcher's core's cache while they are checked (store.streamed_reads; a Redis Cluster's
nodes each in turn).

The fetcher holds the same store configuration (URL, cluster, TLS, ACL user, MAC keys) as
the worker. A fetcher that cannot start, or dies, costs nothing but its advantage: the read
is made in this process instead, and the next one starts a new fetcher.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from store import BlockRead, KVBlock, KVFormat, RedisStore, StoreConfig
from store.errors import BlockRejected, RejectReason, StoreError, StoreUnavailable
from store.streamed_reads import PayloadAt

log = logging.getLogger(__name__)

FETCHER_NICE = 19
SHARED_MEMORY_DIR = Path("/dev/shm")
_FRAME = struct.Struct("!Q")
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]


class BlockReader(Protocol):
    """Reads and verifies stored blocks: RedisStore, or a KVFetcher in front of one."""

    def get_blocks(
        self, reads: Sequence[BlockRead], kv_format: KVFormat
    ) -> list[KVBlock | BlockRejected]: ...


@dataclass(frozen=True)
class _Refused:
    """A block that failed a check (BlockRejected does not survive pickling)."""

    block_name: str
    reason: str
    detail: str

    def rejected(self) -> BlockRejected:
        return BlockRejected(self.block_name, RejectReason(self.reason), self.detail)


class KVFetcher:
    """``get_blocks`` as RedisStore has it, read by the fetcher process (started on first
    use); ``fallback`` reads in this process when the fetcher cannot. Thread-safe: one read
    at a time."""

    def __init__(self, config: StoreConfig, fallback: RedisStore) -> None:
        self._config = config
        self._fallback = fallback
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def get_blocks(
        self, reads: Sequence[BlockRead], kv_format: KVFormat
    ) -> list[KVBlock | BlockRejected]:
        """The blocks, verified (a failed check comes back as BlockRejected). Raises
        StoreUnavailable / StoreError as the store does."""
        with self._lock:
            try:
                reply = self._ask((list(reads), kv_format))
            except (OSError, EOFError, pickle.PickleError) as exc:
                log.warning("KV fetcher failed (%s); reading in the worker process", exc)
                self._stop()
                reply = None
        if reply is None:
            return self._fallback.get_blocks(reads, kv_format)
        kind, *rest = reply
        if kind == "unavailable":
            raise StoreUnavailable(rest[0])
        if kind == "error":
            raise StoreError(rest[0])
        path, items = rest
        mapped = _map(path) if path else memoryview(b"")
        return [
            item.rejected()
            if isinstance(item, _Refused)
            else KVBlock(
                kv_format,
                item.prefix_hash,
                item.num_tokens,
                mapped[item.offset : item.offset + item.length],
            )
            for item in items
        ]

    def start(self) -> None:
        """Starts the fetcher process ahead of the first read (its imports take a while at
        its priority); a failure here is logged, and the first read tries again."""
        with self._lock:
            try:
                self._started()
            except OSError as exc:
                log.warning("KV fetcher did not start (%s); reads stay in this process", exc)

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _ask(self, message: object) -> Any:
        process = self._started()
        assert process.stdin is not None and process.stdout is not None
        _send(process.stdin, message)
        return _receive(process.stdout)

    def _started(self) -> subprocess.Popen[bytes]:
        if self._process is not None and self._process.poll() is None:
            return self._process
        environment = dict(os.environ)
        environment["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(_PACKAGE_ROOT), environment.get("PYTHONPATH", "")) if p
        )
        self._process = subprocess.Popen(
            [sys.executable, "-m", "worker.kv_fetcher"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=environment,
        )
        assert self._process.stdin is not None
        _send(self._process.stdin, self._config)
        return self._process

    def _stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.stdin is not None:
            process.stdin.close()  # the fetcher ends at the end of its input
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _map(path: str) -> memoryview:
    """The reply's file, mapped read-only (the loader only reads it: kv_layout.host_tensor)
    and unlinked: the mapping lives as long as a view of it does. Shared, not private: a
    writable private mapping that is populated copies every page on the spot, ~94 MB for a
    4k-token context, beside the engine's step.

    Not populated here either: with MAP_POPULATE (all ~23,000 pages of a 4k context mapped
    at once, under the engine process's memory-map lock) the engine step beside it took
    ~10 ms longer in every traced resume of the stall benchmark, and without it that step
    was not slower. Left to fault in, the pages cost the loader's copy a few ms more, on
    the loader's thread."""
    with open(path, "rb") as file:
        try:
            mapped = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.unlink(path)
    return memoryview(mapped)


def _send(pipe: IO[bytes], message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    pipe.write(_FRAME.pack(len(data)) + data)
    pipe.flush()


def _receive(pipe: IO[bytes]) -> Any:
    header = pipe.read(_FRAME.size)
    if len(header) < _FRAME.size:
        raise EOFError("the KV fetcher closed its pipe")
    (length,) = _FRAME.unpack(header)
    data = pipe.read(length)
    if len(data) < length:
        raise EOFError("the KV fetcher closed its pipe mid-reply")
    return pickle.loads(data)


# ---- the fetcher process -------------------------------------------------------------------


def _fetched(
    store: RedisStore, reads: Sequence[BlockRead], kv_format: KVFormat
) -> tuple[str, list[PayloadAt | _Refused]]:
    """Reads ``reads`` into one shared-memory file: its path ('' when no block passed) and
    what the reader needs of each block. Each value goes from the socket to the file in
    pieces, checked on the way (RedisStore.get_blocks_into)."""
    directory = SHARED_MEMORY_DIR if SHARED_MEMORY_DIR.is_dir() else None
    descriptor, path = tempfile.mkstemp(prefix="spotinfer-kv-", dir=directory)
    try:
        with os.fdopen(descriptor, "wb", buffering=0) as file:
            loaded = store.get_blocks_into(reads, kv_format, file)
    except BaseException:
        os.unlink(path)
        raise
    items = [
        _Refused(item.block_name, item.reason.value, item.detail)
        if isinstance(item, BlockRejected)
        else item
        for item in loaded
    ]
    if not any(isinstance(item, PayloadAt) for item in items):
        os.unlink(path)
        return "", items
    return path, items


def serve(inbound: IO[bytes], outbound: IO[bytes]) -> None:
    """The fetcher's loop: a store configuration, then reads until the input ends."""
    config = _receive(inbound)
    os.nice(FETCHER_NICE)
    store = RedisStore.from_config(config)
    try:
        while True:
            try:
                reads, kv_format = _receive(inbound)
            except EOFError:
                return
            try:
                reply: tuple[Any, ...] = ("ok", *_fetched(store, reads, kv_format))
            except StoreUnavailable as exc:
                reply = ("unavailable", str(exc))
            except StoreError as exc:
                reply = ("error", str(exc))
            _send(outbound, reply)
    finally:
        store.close()


if __name__ == "__main__":
    # Through the module's own name: what it pickles must unpickle as worker.kv_fetcher's.
    from worker.kv_fetcher import serve as serve_by_name

    serve_by_name(sys.stdin.buffer, sys.stdout.buffer)
