"""Asynchronous device <-> host KV copies: a pool of pinned host buffers, a side stream and
an event per copy.

Like kv_copy.py this module knows torch and nothing else, so tests/gpu and
benchmarks/gpu_kv_copy.py run it on a machine with only PyTorch. The connector's worker side
(spot_connector_worker.py) does every save and load through a `CopyStream`:

- **save**: the side stream waits for the compute stream (the forward pass that wrote the
  blocks), gathers the blocks on the device and copies them into a pinned host buffer
  without blocking the model runner's thread; an event marks the end. The caller polls
  `Transfer.done()` and calls `Transfer.finish()` once it is (the pinned bytes land in the
  caller's own buffer, a writer's or the daemon's ring slot, and the pinned buffer goes back
  to the pool); the cache slots stay held until then.
- **load**: the stored bytes are copied into a pinned buffer, scattered into the cache on the
  side stream, and the compute stream waits for the event, so the next forward pass reads
  the loaded blocks without the host waiting; an asynchronous load's thread waits for the
  event instead and then reports the request received.

On a CPU cache there is no stream: a save gathers straight into the caller's buffer, a load
scatters straight from the stored bytes, and every transfer is done when it is returned, so
the same calls serve both. The pool is bounded: when it is spent a copy goes through a
pageable buffer (counted in ``pageable_fallbacks``) rather than wait.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

import torch

from common.cpu_affinity import unpin_current_thread
from worker.kv_copy import KVCopier

DEFAULT_POOL_BYTES = 256 << 20
HIGH_PRIORITY = -1
"""The side stream's priority (lower is higher in CUDA): a copy's small gather kernels are
scheduled as soon as any of the forward pass's thread blocks retires, instead of queuing
behind whole kernels of it (benchmarks/gpu_kv_copy.py measures both)."""

log = logging.getLogger(__name__)


class HostBufferPool:
    """Reusable host buffers, pinned where ``pinned`` (page-locked, for asynchronous copies),
    up to ``max_bytes`` in all. `take` returns a flat uint8 buffer of at least the size
    asked (sliced to it); `give` returns it. Thread-safe."""

    def __init__(self, pinned: bool, max_bytes: int = DEFAULT_POOL_BYTES) -> None:
        self.pinned = pinned
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._lent: dict[int, torch.Tensor] = {}  # address -> the buffer a piece starts
        self.pageable_fallbacks = 0

    @property
    def allocated_bytes(self) -> int:
        with self._lock:
            return self._allocated

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of ``nbytes`` bytes: a free one big enough, a new one while the pool has
        room, else (counted) a pageable one outside the pool."""
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes]
            if fits:
                base = min(fits, key=torch.Tensor.numel)
                self._free = [b for b in self._free if b is not base]
            elif self._allocated + nbytes <= self.max_bytes:
                base = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
                self._allocated += nbytes
            else:
                self.pageable_fallbacks += 1
                return torch.empty(nbytes, dtype=torch.uint8)
            self._lent[base.data_ptr()] = base
            return base[:nbytes]

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer `take` gave (one from outside the pool is simply let go)."""
        with self._lock:
            base = self._lent.pop(buffer.data_ptr(), None)
            if base is not None:
                self._free.append(base)


class Transfer:
    """One copy in flight: `done` polls its event (True at once on CPU), `wait` blocks on
    it, `finish` completes it on the host (once done) and returns its buffers."""

    def __init__(
        self,
        event: torch.cuda.Event | None = None,
        pool: HostBufferPool | None = None,
        staging: torch.Tensor | None = None,
        destination: torch.Tensor | None = None,
    ) -> None:
        self._event = event
        self._pool = pool
        self._staging = staging
        self._destination = destination
        self._finished = False

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def finish(self) -> None:
        """Waits if need be, lands a save's pinned bytes in its destination and gives the
        pinned buffer back. Idempotent."""
        if self._finished:
            return
        self.wait()
        if self._staging is not None and self._destination is not None:
            self._destination.copy_(self._staging)
        if self._staging is not None and self._pool is not None:
            self._pool.give(self._staging)
        self._finished = True


class CopyStream:
    """Saves and loads of one cache's blocks, on a side stream of the cache's CUDA device
    (module docstring); on CPU, plain synchronous copies."""

    def __init__(
        self,
        device: torch.device | str,
        pool_bytes: int = DEFAULT_POOL_BYTES,
        priority: int = HIGH_PRIORITY,
    ) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.pool = HostBufferPool(pinned=self.is_cuda, max_bytes=pool_bytes if self.is_cuda else 0)
        self._stream = torch.cuda.Stream(self.device, priority) if self.is_cuda else None

    def save(
        self,
        copier: KVCopier,
        views: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        last_tokens: int,
        out: torch.Tensor,
        header_bytes: int = 0,
    ) -> Transfer:
        """Start copying blocks ``block_ids`` into ``out`` (after ``header_bytes``, as
        `KVCopier.gather`); ``out`` holds them once the transfer is finished."""
        if self._stream is None:
            copier.gather(views, block_ids, last_tokens, header_bytes, out=out)
            return Transfer()
        direct = out.is_pinned()
        staging = out if direct else self.pool.take(out.numel())
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            copier.gather(views, block_ids, last_tokens, header_bytes, out=staging, sync=False)
            event = torch.cuda.Event()
            event.record(self._stream)
        if direct:
            return Transfer(event)
        return Transfer(event, self.pool, staging, out)

    def load(
        self,
        copier: KVCopier,
        views: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        value: torch.Tensor,
        last_tokens: int = 0,
        descriptor: str | None = None,
    ) -> Transfer:
        """Start writing ``value`` (host bytes) into blocks ``block_ids``; the compute stream
        of the calling thread waits for it before its next work, and `Transfer.wait` waits
        on the host. Finish the transfer to give its pinned buffer back."""
        if self._stream is None:
            copier.scatter(views, block_ids, value, last_tokens, descriptor)
            return Transfer()
        staging = value if value.is_pinned() else self.pool.take(value.numel())
        if staging is not value:
            staging.copy_(value)
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            copier.scatter(views, block_ids, staging, last_tokens, descriptor)
            event = torch.cuda.Event()
            event.record(self._stream)
        compute.wait_event(event)
        return Transfer(event, self.pool if staging is not value else None, staging)


class InOrderLanding:
    """Runs actions in the order they are given, each once the transfer before it (if any)
    has finished: a save's block is handed to the writer only when its bytes are on the
    host, and a pause's mark, a commit or a slot release after the saves that precede it.
    An action whose transfer is done and that has nothing before it runs at once on the
    caller's thread (always so on CPU); the others run on a thread of their own, which waits
    on the transfers' events."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = 0
        self._queue: queue.Queue[tuple[Transfer | None, Callable[[], None] | None] | None] = (
            queue.Queue()
        )
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def land(self, transfer: Transfer | None, action: Callable[[], None] | None = None) -> None:
        with self._lock:
            if self._pending == 0 and (transfer is None or transfer.done()):
                direct = True
            else:
                direct = False
                self._pending += 1
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="spot-kv-landing", daemon=True
                    )
                    self._thread.start()
        if direct:
            if transfer is not None:
                transfer.finish()
            if action is not None:
                action()
            return
        self._queue.put((transfer, action))

    def _run(self) -> None:
        unpin_current_thread()
        while (item := self._queue.get()) is not None:
            transfer, action = item
            try:
                if transfer is not None:
                    transfer.finish()
                if action is not None:
                    action()
            except Exception:
                log.exception("a KV transfer or what follows it failed")
            finally:
                with self._lock:
                    self._pending -= 1

    def close(self, timeout: float) -> bool:
        """Lands what is queued (up to ``timeout`` seconds); True when nothing is left."""
        with self._lock:
            thread = self._thread
        if thread is None:
            return True
        self._queue.put(None)
        thread.join(timeout)
        return not thread.is_alive()
