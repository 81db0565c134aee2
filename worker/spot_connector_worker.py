"""The spot connector's worker side (in the model runner): it copies verified payloads into
the paged cache, copies the blocks the scheduler side named out of it after a forward pass,
and hands them to the write-behind thread (store/block_writer.py). It only copies bytes: which
block is which, the scheduler side decided. See spot_connector.py for both sides.

A load is synchronous (copied before the step's forward pass) or, when the scheduler side
lists its request in ``receiving``, asynchronous: copied on the loader thread while the
step runs (vLLM holds the request back until get_finished names it; the slots it fills
belong to no running request) and reported once done. A copy that fails reports its slots
through `take_load_errors`, so vLLM recomputes them instead of reading garbage.

On a tensor-parallel worker every rank runs one of these: each saves its own shard of a block
(under its own keys, ``kv_format.shard``) and loads its own payload of a BlockLoad; token
commits and marks are the same on every rank, so rank 0 alone writes them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING

import torch

from common.cpu_affinity import unpin_current_thread
from store import KVFormat, RedisStore
from store.block_codec import header_bytes
from store.block_writer import KVBlockWriter, PendingBlock
from worker.constants import KV_WRITE_QUEUE_BLOCKS
from worker.daemon_writer import HandoffWriter
from worker.kv_copy import KVCopier, as_bytes
from worker.kv_layout import check_tensors, layer_names
from worker.kv_runs import LoadRun, end_to_end
from worker.kv_transfer import CopyStream, InOrderLanding
from worker.persist_stats import (
    CACHED_BLOCKS,
    DROPPED_BLOCKS,
    LOADED_STAGED_BLOCKS,
    LOADED_STORE_BLOCKS,
    MAC_REJECTED_BLOCKS,
    WRITTEN_BLOCKS,
    WRITTEN_BYTES,
    PersistReporter,
    PersistStats,
)
from worker.spot_connector_metadata import BlockLoad, SpotConnectorMetadata

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

WRITER_CLOSE_SECONDS = 5.0

log = logging.getLogger(__name__)


class SpotConnectorWorker:
    """The worker role's half of `SpotKVConnector` (vLLM calls it from the model runner)."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        kv_format: KVFormat,
        copier: KVCopier,
        store: RedisStore,
        tp_rank: int = 0,
        handoff_socket: str = "",
    ) -> None:
        self._kv_format = kv_format
        self._tp_rank = tp_rank
        self._copier = copier
        self._header_bytes = header_bytes(kv_format)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._layer_names = layer_names(kv_cache_config)
        self._store = store
        self._tensors: list[torch.Tensor] = []
        self._copies = CopyStream("cpu")
        self._landing = InOrderLanding()
        self._released: set[str] = set()
        self._released_lock = threading.Lock()  # the landing thread adds to it on a GPU
        self._loaded_staged = 0
        self._loaded_from_store = 0
        self._found_cached = 0
        self._mac_rejected = 0
        self._writer: KVBlockWriter | HandoffWriter
        if handoff_socket:
            full_blocks, _ = copier.last_block_tokens(kv_format.block_tokens)
            self._writer = HandoffWriter(
                handoff_socket,
                store,
                kv_format,
                self._header_bytes + copier.value_bytes(full_blocks),
                KV_WRITE_QUEUE_BLOCKS,
            )
        else:
            self._writer = KVBlockWriter(store, kv_format, KV_WRITE_QUEUE_BLOCKS)
        self._persist_reporter = PersistReporter()
        self._loader = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="spot-kv-load", initializer=unpin_current_thread
        )
        self._receiving: list[tuple[str, Future[None]]] = []
        self._load_lock = threading.Lock()  # the loader thread counts and reports errors too
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors = [kv_caches[name] for name in self._layer_names]
        check_tensors(tensors, self._num_blocks, self._copier)
        self._tensors = as_bytes(tensors)
        self._copies = CopyStream(self._tensors[0].device)

    def start_load_kv(self, meta: SpotConnectorMetadata) -> None:
        """Fills every layer of the step's synchronous loads before the forward pass, and
        starts its asynchronous ones on the loader thread."""
        self._found_cached += meta.cached_blocks
        self._mac_rejected += meta.mac_rejected_blocks
        later: dict[str, list[BlockLoad]] = {vllm_id: [] for vllm_id in meta.receiving}
        now: list[BlockLoad] = []
        for load in meta.loads:
            later.get(load.vllm_id, now).append(load)
        for run in self._runs(now):
            self._copy_in(run)
        for vllm_id, loads in later.items():
            self._receiving.append((vllm_id, self._loader.submit(self._copy_in_all, loads)))

    def _runs(self, loads: list[BlockLoad]) -> Iterator[LoadRun]:
        """``loads`` in runs that one copy each fills (worker/kv_runs.py); through a device's
        pinned buffers, no run larger than a quarter of their pool."""
        largest = self._copies.pool.max_bytes // 4 if self._copies.is_cuda else None
        return end_to_end(self._copier, self._tp_rank, loads, largest)

    def _copy_in_all(self, loads: list[BlockLoad]) -> None:
        for run in self._runs(loads):
            try:
                self._copy_in(run, received=True)
            except Exception:
                log.exception(
                    "loading %d cache blocks failed; vLLM recomputes them", len(run.block_ids)
                )
                with self._load_lock:
                    self._load_errors.update(run.block_ids)

    def _copy_in(self, run: LoadRun, received: bool = False) -> None:
        """One run's copy into its slots. ``received``: asynchronous loads, reported once
        their copy is done (so this waits for it); else the next forward pass waits for it on
        the device, and the landing gives its pinned buffer back."""
        transfer = self._copies.load(
            self._copier, self._tensors, run.block_ids, run.value(), run.last
        )
        if received:
            transfer.finish()
        else:
            self._landing.land(transfer)
        staged = sum(1 for load in run.loads if load.staged)
        with self._load_lock:
            self._loaded_staged += staged
            self._loaded_from_store += len(run.loads) - staged

    def take_load_errors(self) -> set[int]:
        """Cache slots whose load failed since the last call (vLLM recomputes them)."""
        with self._load_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_save(self, meta: SpotConnectorMetadata) -> None:
        """Copies the step's saves out of the cache (whole blocks, all layers) after the
        forward pass and queues them, with the step's commits and marks (rank 0's), for the
        writer. On a GPU the copies run on a side stream: each block, and every mark and
        release after it, reaches the writer in order once its bytes are on the host
        (kv_transfer.InOrderLanding); on CPU at once."""
        first_rank = self._tp_rank == 0
        writer, land = self._writer, self._landing.land
        for commit in meta.commits if first_rank else ():
            land(None, partial(writer.submit_tokens, commit))
        for save in meta.saves:
            last = self._copier.last_block_tokens(save.num_tokens)[1]
            nbytes = self._header_bytes + self._copier.value_bytes(len(save.block_ids), last)
            buffer = self._writer.buffer(nbytes, save.required)
            if buffer is None:
                continue  # dropped (counted): the queue or the daemon's ring is full
            block = PendingBlock(
                request_id=save.request_id,
                block_index=save.block_index,
                prefix_hash=save.prefix_hash,
                data=buffer,
                num_tokens=save.num_tokens,
            )
            transfer = self._copies.save(
                self._copier, self._tensors, save.block_ids, last, buffer, self._header_bytes
            )
            land(transfer, partial(writer.submit, block, required=save.required))
        for request_id in meta.without_kv if first_rank else ():
            land(None, partial(writer.submit_no_kv, request_id))
        for commit in meta.final_commits if first_rank else ():
            land(None, partial(writer.submit_tokens, commit, final=True))
        for request_id, full_blocks, tail_tokens in meta.paused:
            land(None, partial(writer.submit_paused, request_id, full_blocks, tail_tokens))
        if meta.released:
            # Once the copies before it are on the host, the cache slots may be freed.
            land(None, partial(self._release, meta.released))

    def _release(self, vllm_ids: list[str] | set[str]) -> None:
        with self._released_lock:
            self._released.update(vllm_ids)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """The vLLM ids whose blocks are copied out, so vLLM may free them, and those whose
        asynchronous loads are copied in, so vLLM may schedule them."""
        received = {vllm_id for vllm_id, copy in self._receiving if copy.done()}
        if received:
            self._receiving = [(i, copy) for i, copy in self._receiving if i not in received]
        with self._released_lock:
            released, self._released = self._released, set()
        return released or None, received or None

    def get_kv_connector_stats(self) -> PersistStats | None:
        """What the writer persisted since the last call (the worker's metrics add it up)."""
        return self._persist_reporter.report(
            {
                WRITTEN_BLOCKS: self._writer.written_blocks,
                WRITTEN_BYTES: self._writer.written_bytes,
                DROPPED_BLOCKS: self._writer.dropped_blocks,
                LOADED_STAGED_BLOCKS: self._loaded_staged,
                LOADED_STORE_BLOCKS: self._loaded_from_store,
                CACHED_BLOCKS: self._found_cached,
                MAC_REJECTED_BLOCKS: self._mac_rejected,
            }
        )

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
        if not self._landing.close(WRITER_CLOSE_SECONDS):
            log.warning("KV copies still in flight at shutdown: their blocks are not written")
        self._writer.close(WRITER_CLOSE_SECONDS)
        self._store.close()
