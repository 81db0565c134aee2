"""The spot connector's scheduler side (in the engine core): it tracks the requests that carry
our id, plans what a resume loads from staging or Redis, and names, step by step, the blocks
to save (block_saves.py decides which), the token lists to commit and the cache slots to keep
until they are copied. See spot_connector.py for both sides at once.

Block identity is the store's hash chain over the token ids and the model fingerprint; this
side has every request's token ids, so it names each block by its hash. A tensor-parallel
worker stores one shard per rank (store/keys.py): a resume reads every rank's shard of a
block, uses the block only if all of them verify, and hands each rank its own payload.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.cpu_affinity import unpin_current_thread
from store import (
    BlockRejected,
    KVBlock,
    KVFormat,
    RedisStore,
    RejectReason,
    StoreUnavailable,
    TokenCommit,
    block_hashes,
    block_reads,
)
from store.block_codec import Buffer, decode_block
from store.block_refs import BlockRead
from worker.block_saves import BlockSaves, Flush, add_flushes
from worker.constants import (
    KV_PARAM_FIRST_INDEX,
    KV_PARAM_REQUEST_ID,
    KV_PARAM_RESUME,
    KV_PARAM_TENANT,
    KV_PARAM_WARM,
    LAYOUT_REJECTED_REQUEST_PREFIX,
    LOOKUP_ATTEMPTS,
    MAC_REJECTED_REQUEST_PREFIX,
)
from worker.kv_fetcher import BlockReader, KVFetcher
from worker.kv_staging import read_staged, staged_name
from worker.persist_rate_cap import PersistRateCap
from worker.persist_stats import DEFERRED_BLOCKS, PersistStats
from worker.spot_connector_metadata import BlockLoad, SpotConnectorMetadata

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# A stored tail for other tokens than asked is one a later pause will overwrite, not damage.
_STALE_TAIL_REASONS = frozenset(
    {RejectReason.MISSING, RejectReason.PREFIX_HASH, RejectReason.GEOMETRY}
)

Sharded = tuple[KVBlock, ...]
"""One stored block as every rank's shard of it (one element for an unsharded worker)."""


@dataclass
class _Tracked:
    """Scheduler-side state of one request that persists its KV."""

    request: Request
    request_id: str  # ours; vLLM's id carries a suffix
    resume: bool
    warm: bool = False  # a migration target's warm-up: loads only, never saves
    first_index: int = 0  # output index of the engine's first output token
    tenant: str = ""  # whose request: its blocks are named by the tenant's chain
    chain: list[bytes] = field(default_factory=list)  # hashes of blocks 0.. named so far
    saved_blocks: int = 0  # blocks [0, saved_blocks) are stored (saved or loaded)
    full_seen: int = 0  # full blocks counted so far as saved or held back by the rate cap
    plan: _LoadPlan | None = None
    lookup: Future[_LoadPlan] | None = None  # kv_load async: the store read under way
    lookup_computed: int = -1  # the local hit that read was planned from
    loaded_tokens: int = 0
    rejected_blocks: int = 0
    mac_rejected_blocks: int = 0


@dataclass(frozen=True)
class _LoadPlan:
    first_block: int  # index of the first block to load (the local hit ends before it)
    blocks: list[Sharded]
    matched_tokens: int  # tokens beyond the local hit whose KV the blocks hold
    staged: int = 0  # how many of ``blocks`` (the leading ones) came from staging memory
    skip_blocks: int = 0  # engine blocks of the first chunk that the local hit holds already


def load_blocks(
    wanted: list[BlockRead],
    staging_roots: Sequence[Path],
    kv_formats: Sequence[KVFormat],
    store: RedisStore,
    reader: BlockReader | None = None,
) -> tuple[list[Sharded | BlockRejected], list[bool]]:
    """``wanted`` blocks, every shard of each (``kv_formats``: one per rank, rank order),
    from the staging memory where a migration prefetched them, or where the node's daemon
    put what a peer pushed (``staging_roots``; verified like a store read),
    the rest from Redis through ``reader`` (the store itself by default), one round trip per
    shard; with, per block, whether it came from staging. A block with a refused shard is
    refused (the first refusal says why)."""
    shards = [
        _load_shard(
            [dataclasses.replace(read, shard=form.shard) for read in wanted],
            staging_roots,
            form,
            store,
            reader or store,
        )
        for form in kv_formats
    ]
    blocks: list[Sharded | BlockRejected] = []
    for of_block in zip(*(loaded for loaded, _ in shards), strict=True):
        refused = [block for block in of_block if isinstance(block, BlockRejected)]
        blocks.append(
            refused[0] if refused else tuple(b for b in of_block if isinstance(b, KVBlock))
        )
    staged = [all(flags) for flags in zip(*(flags for _, flags in shards), strict=True)]
    return blocks, staged


def _payloads(shards: Sharded) -> tuple[Buffer, ...]:
    """Each rank's payload of a block. The ranks of a tensor-parallel worker run in other
    processes and get the step's metadata pickled: a staged block's mapped view is copied to
    bytes for them (an unsharded worker's runner maps it where it is)."""
    if len(shards) == 1:
        return (shards[0].payload,)
    return tuple(bytes(shard.payload) for shard in shards)


def read_blocks(
    request_id: str,
    wanted: list[BlockRead],
    staging_roots: Sequence[Path],
    kv_formats: Sequence[KVFormat],
    store: RedisStore,
    attempts: int,
    reader: BlockReader | None = None,
) -> tuple[list[Sharded | BlockRejected], list[bool]] | None:
    """load_blocks, tried ``attempts`` times while Redis is unavailable; None when it stays
    so (the resume recomputes)."""
    for attempt in range(1, attempts + 1):
        try:
            return load_blocks(wanted, staging_roots, kv_formats, store, reader)
        except StoreUnavailable as exc:
            again = attempt < attempts
            log.log(
                logging.INFO if again else logging.WARNING,
                "resume of %s: Redis unavailable, %s (%s)",
                request_id,
                "reading again" if again else "recomputing",
                exc,
            )
    return None


def _load_shard(
    wanted: list[BlockRead],
    staging_roots: Sequence[Path],
    kv_format: KVFormat,
    store: RedisStore,
    reader: BlockReader,
) -> tuple[list[KVBlock | BlockRejected], list[bool]]:
    """load_blocks for one shard."""
    loaded: list[KVBlock | BlockRejected | None] = [None] * len(wanted)
    for root in staging_roots:
        for position, read in enumerate(wanted):
            if loaded[position] is not None:
                continue
            # A tail is staged only by a peer's push (named by its content hash, like a block).
            data = read_staged(root, staged_name(read.prefix_hash, read.shard))
            if data is None:
                continue
            try:
                loaded[position] = decode_block(
                    read.name, data, kv_format, read.prefix_hash, read.num_tokens, store.keyring
                )
            except BlockRejected as rejected:
                log.warning("staged %s; reading it from the store instead", rejected)
    missing = [position for position, block in enumerate(loaded) if block is None]
    if missing:
        fetched = reader.get_blocks([wanted[p] for p in missing], kv_format)
        for position, block in zip(missing, fetched, strict=True):
            loaded[position] = block
    from_store = set(missing)
    staged = [position not in from_store for position in range(len(wanted))]
    return [block for block in loaded if block is not None], staged


def _lookups(
    kv_load: str, fetcher: KVFetcher | None
) -> tuple[ThreadPoolExecutor | None, KVFetcher | None]:
    """kv_load async: the thread the store reads run on (None: inside the scheduler call),
    and the fetcher it reads through (started at once: its process takes a while)."""
    if kv_load != "async":
        return None, None
    lookups = ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="spot-kv-lookup", initializer=unpin_current_thread
    )
    if fetcher is not None:
        lookups.submit(fetcher.start)
    return lookups, fetcher


class SpotConnectorScheduler:
    """The scheduler role's half of `SpotKVConnector` (vLLM calls it from the engine core's
    scheduler, one thread). ``policy``: ``eager``, ``lazy``, ``hybrid`` or ``off`` (see
    spot_connector.py); ``rate_cap_bytes_per_second``: hybrid's cap (persist_rate_cap.py),
    measured on ``clock``;
    ``staging_root``: where a migration staged blocks for this worker, if anywhere;
    ``peer_staging_root``: where the node's daemon puts the blocks (and tails) a peer daemon
    pushed for a migration to this worker, if anywhere;
    ``loads_refused``: why resumes must recompute instead of loading (empty: they load);
    ``kv_load``: ``async`` reads a resume's stored KV on a thread while the engine steps on
    (vLLM asks again each step until the count is known) and loads it through vLLM's
    asynchronous path; ``sync`` reads it inside the scheduler call (every other sequence on
    the worker waits for the read) and loads it before the next forward pass; ``fetcher``:
    where the lookup thread reads from Redis (kv_fetcher.py; None: in this process)."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        kv_format: KVFormat,
        policy: str,
        store: RedisStore,
        staging_root: Path | None,
        loads_refused: str = "",
        kv_load: str = "async",
        shard_formats: Sequence[KVFormat] = (),
        fetcher: KVFetcher | None = None,
        rate_cap_bytes_per_second: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        peer_staging_root: Path | None = None,
    ) -> None:
        assert (policy == "hybrid") == (rate_cap_bytes_per_second > 0), (
            "the worker's config pairs a rate cap with hybrid, and only with it"
        )
        self._kv_cache_config = kv_cache_config
        # Every rank's format, rank order (the first is ``kv_format``): a resume reads them all.
        self._shard_formats = tuple(shard_formats) or (kv_format,)
        self._lookups, self._fetcher = _lookups(kv_load, fetcher)
        # The lookup thread counts refused blocks; the scheduler thread reports them.
        self._counts_lock = threading.Lock()
        self._receiving: list[str] = []
        self._loads_refused = loads_refused
        # A stored value is a chunk of kv_format.block_tokens tokens: this many engine blocks.
        self._engine_block_tokens = int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
        self._blocks_per_chunk = kv_format.block_tokens // self._engine_block_tokens
        self._kv_format = kv_format
        self._policy = policy
        self._store = store
        self._staging_roots = tuple(r for r in (staging_root, peer_staging_root) if r is not None)
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[BlockLoad] = []
        self._flushes: list[Flush] = []
        self._final_commits: list[TokenCommit] = []
        self._cached_blocks = 0
        self._mac_rejected_blocks = 0
        # "<refusal prefix><request id>" -> blocks (see worker/constants.py).
        self._rejected_by_request: dict[str, int] = {}
        rate_cap = (
            PersistRateCap(
                rate_cap_bytes_per_second,
                # Every rank writes its shard of each block: the cap counts them all.
                kv_format.layer_count * self._block_bytes_per_layer() * len(self._shard_formats),
                clock,
            )
            if rate_cap_bytes_per_second > 0
            else None
        )
        self._saves = BlockSaves(kv_format, self._engine_block_tokens, rate_cap)

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params or {}
        request_id = params.get(KV_PARAM_REQUEST_ID)
        if isinstance(request_id, str) and request_id:
            self._tracked[request.request_id] = _Tracked(
                request=request,
                request_id=request_id,
                resume=bool(params.get(KV_PARAM_RESUME)),
                warm=bool(params.get(KV_PARAM_WARM)),
                first_index=int(params.get(KV_PARAM_FIRST_INDEX, 0)),
                tenant=str(params.get(KV_PARAM_TENANT, "")),
            )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tracked = self._tracked.get(request.request_id)
        if tracked is None or not tracked.resume:
            return 0, False
        if tracked.plan is None:
            if self._lookups is None:
                plan = self._plan_load(tracked, num_computed_tokens)
            else:
                if tracked.lookup is None or tracked.lookup_computed != num_computed_tokens:
                    # First asked (or the local hit moved since): read on the lookup thread;
                    # None makes vLLM skip the request this step and ask again the next.
                    tracked.lookup = self._lookups.submit(
                        self._plan_load_logged, tracked, num_computed_tokens
                    )
                    tracked.lookup_computed = num_computed_tokens
                    return None, False
                if not tracked.lookup.done():
                    return None, False
                plan, tracked.lookup = tracked.lookup.result(), None
            if not tracked.warm:  # found warmed by the handshake (or left by an earlier run)
                self._cached_blocks += num_computed_tokens // self._kv_format.block_tokens
            tracked.plan = plan
        matched = tracked.plan.matched_tokens
        return matched, self._lookups is not None and matched > 0

    def _plan_load_logged(self, tracked: _Tracked, num_computed_tokens: int) -> _LoadPlan:
        """`_plan_load` on the lookup thread: a failure there costs a recompute, never the
        engine (an exception would otherwise surface in the scheduler's next call)."""
        try:
            return self._plan_load(tracked, num_computed_tokens)
        except Exception:
            log.exception(
                "resume of %s: reading its stored KV failed; recomputing", tracked.request_id
            )
            return _LoadPlan(num_computed_tokens // self._kv_format.block_tokens, [], 0)

    def _plan_load(self, tracked: _Tracked, num_computed_tokens: int) -> _LoadPlan:
        """Read the request's full blocks and its partial tail (a pause stored one), keep the
        verified leading run, cap as vLLM requires."""
        if self._loads_refused:
            log.warning("resume of %s recomputes: %s", tracked.request_id, self._loads_refused)
            return _LoadPlan(num_computed_tokens // self._kv_format.block_tokens, [], 0)
        block_tokens = self._kv_format.block_tokens
        first_block = num_computed_tokens // block_tokens
        token_ids = list(tracked.request.all_token_ids)
        reads = block_reads(tracked.request_id, self._kv_format, token_ids, False, tracked.tenant)
        reads = reads[first_block:]
        # The tail a pause stores holds every token but the last (vLLM computes that one); it
        # follows the full blocks, or stands in for the last one when that never filled.
        tail = None
        if (len(token_ids) - 1) % block_tokens:
            kv_reads = block_reads(
                tracked.request_id, self._kv_format, token_ids[:-1], tenant=tracked.tenant
            )
            if kv_reads[-1].block_index >= first_block:
                tail = kv_reads[-1]
        wanted = reads + ([tail] if tail is not None else [])
        # On the lookup thread a retry costs no other sequence a thing; inside the scheduler
        # call (kv_load sync) every sequence waits for it, so there is none.
        attempts = LOOKUP_ATTEMPTS if self._lookups is not None else 1
        read = read_blocks(
            tracked.request_id,
            wanted,
            self._staging_roots,
            self._shard_formats,
            self._store,
            attempts,
            self._fetcher,
        )
        if read is None:
            return _LoadPlan(first_block, [], 0)
        loaded, staged = read
        usable: list[Sharded] = []
        for block in loaded[: len(reads)]:
            if isinstance(block, BlockRejected):
                self._count_rejected(tracked, block, RejectReason.MISSING)
                break
            usable.append(block)
        if tail is not None and first_block + len(usable) == tail.block_index:
            block = loaded[-1]
            if isinstance(block, BlockRejected):
                self._count_rejected(tracked, block, *_STALE_TAIL_REASONS)
            else:
                usable.append(block)
        # vLLM computes at least the last prompt token itself; a count that does not end on
        # a block boundary is fine (the last loaded block is then only partly used).
        stored = sum(block[0].num_tokens for block in usable)
        end = min(first_block * block_tokens + stored, len(token_ids) - 1)
        matched = max(0, end - num_computed_tokens)
        if not matched:
            return _LoadPlan(first_block, [], 0)
        skip = (num_computed_tokens - first_block * block_tokens) // self._engine_block_tokens
        return _LoadPlan(first_block, usable, matched, sum(staged[: len(usable)]), skip)

    def _count_rejected(
        self, tracked: _Tracked, block: BlockRejected, *harmless: RejectReason
    ) -> None:
        """A block that cannot be used: count and log it, unless its reason is ``harmless``
        (absent, or a tail from an earlier pause that a later one will overwrite)."""
        if block.reason in harmless:
            return
        tracked.rejected_blocks += 1
        prefix = {
            RejectReason.MAC: MAC_REJECTED_REQUEST_PREFIX,
            RejectReason.LAYOUT: LAYOUT_REJECTED_REQUEST_PREFIX,
        }.get(block.reason)
        if block.reason is RejectReason.MAC:
            tracked.mac_rejected_blocks += 1
        if prefix is not None:
            with self._counts_lock:
                self._mac_rejected_blocks += block.reason is RejectReason.MAC
                by_request = self._rejected_by_request
                key = prefix + tracked.request_id
                by_request[key] = by_request.get(key, 0) + 1
        log.warning("resume of %s: %s; its tokens are recomputed", tracked.request_id, block)

    def report(self) -> PersistStats | None:
        """Since the last call: the blocks refused by their MAC or their layout, per request,
        and the blocks the rate cap held back as they filled (vLLM sends the scheduler role's
        stats with the outputs of the step they were found in)."""
        with self._counts_lock:
            rejected, self._rejected_by_request = self._rejected_by_request, {}
        data = dict(rejected)
        deferred = self._saves.take_deferred()
        if deferred:
            data[DEFERRED_BLOCKS] = deferred
        return PersistStats(data=data) if data else None

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None or tracked.plan is None:
            return
        plan, tracked.plan = tracked.plan, None
        if num_external_tokens == 0 or not plan.blocks:
            return
        block_ids = blocks.get_block_ids()[0]
        for offset, shards in enumerate(plan.blocks):
            block = shards[0]
            slots = self._saves.slots(block_ids, plan.first_block + offset, block.num_tokens)
            # The local hit may end inside the first chunk: its leading blocks are cached.
            first = plan.skip_blocks if offset == 0 else 0
            if len(slots) <= first:
                break
            self._loads.append(
                BlockLoad(
                    slots[first:],
                    _payloads(shards),
                    offset < plan.staged,
                    block.num_tokens,
                    first,
                    request.request_id,
                )
            )
        if self._lookups is not None:
            # vLLM waits for this id in get_finished (it was told the load is asynchronous).
            self._receiving.append(request.request_id)
        # A loaded tail is not a saved block: once full it must be saved like any other.
        full = [shards[0] for shards in plan.blocks if shards[0].is_full]
        tracked.chain = [block.prefix_hash for block in full]
        if plan.first_block:
            tracked.chain = block_hashes(
                self._kv_format.model_fingerprint,
                list(request.all_token_ids),
                self._kv_format.block_tokens,
                tracked.tenant,
            )[: plan.first_block + len(full)]
        tracked.saved_blocks = plan.first_block + len(full)
        tracked.loaded_tokens = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SpotConnectorMetadata:
        with self._counts_lock:
            mac_rejected, self._mac_rejected_blocks = self._mac_rejected_blocks, 0
        meta = SpotConnectorMetadata(
            loads=self._loads,
            receiving=self._receiving,
            cached_blocks=self._cached_blocks,
            mac_rejected_blocks=mac_rejected,
        )
        self._loads, self._receiving, self._cached_blocks = [], [], 0
        if self._flushes:
            block_bytes = self._kv_format.layer_count * self._block_bytes_per_layer()
            add_flushes(meta, self._flushes, block_bytes)
            self._flushes = []
        meta.final_commits, self._final_commits = self._final_commits, []
        if self._policy in ("eager", "hybrid"):
            meta.saves.extend(self._saves.this_step(scheduler_output, self._tracked))
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus as VllmRequestStatus

        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        if tracked.lookup is not None:
            tracked.lookup.cancel()  # aborted while its store read was under way
        delay_free = False
        aborted = request.status == VllmRequestStatus.FINISHED_ABORTED
        if aborted and self._policy != "off" and not tracked.warm:
            flush = self._saves.flush(tracked, block_ids)
            self._flushes.append(flush)
            delay_free = bool(flush.saves)
        elif (
            request.status == VllmRequestStatus.FINISHED_LENGTH_CAPPED
            and self._policy != "off"
            and not tracked.warm
            and request.output_token_ids
        ):
            self._final_commits.append(
                TokenCommit(
                    tracked.request_id, tracked.first_index, tuple(request.output_token_ids)
                )
            )
        if not tracked.resume:
            return delay_free, None
        return delay_free, {
            "spotinfer_loaded_tokens": tracked.loaded_tokens,
            "spotinfer_rejected_blocks": tracked.rejected_blocks,
            "spotinfer_mac_rejected_blocks": tracked.mac_rejected_blocks,
        }

    def _block_bytes_per_layer(self) -> int:
        """One chunk's bytes of one layer."""
        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        return int(getattr(spec, "page_size_bytes", 1)) * self._blocks_per_chunk

    def shutdown(self) -> None:
        if self._lookups is not None:
            self._lookups.shutdown(wait=False, cancel_futures=True)
        if self._fetcher is not None:
            self._fetcher.close()
        self._store.close()
