"""The spot KV connector: vLLM's `KVConnectorBase_V1`, saving KV blocks to Redis and loading
them back into a fresh engine that resumes a request.

vLLM builds one instance per role, from `kv_transfer_config` (see `connector_config`):

    scheduler role (engine core)                 worker role (model runner)
    ----------------------------                 --------------------------
    on_new_request: track requests that carry    register_kv_caches: keep the layer tensors
      our id in kv_transfer_params
    get_num_new_matched_tokens (resume only):    start_load_kv: copy the verified payloads
      read + verify the persisted blocks,          into the named cache slots (whole blocks,
      answer how many leading tokens they hold     all layers) before the forward pass
    update_state_after_alloc: pair the payloads
      with the cache slots vLLM allocated
    build_connector_meta: name the blocks that   wait_for_save: copy those blocks out of the
      became full this step (policy eager)         cache and hand them to the writer thread
    request_finished (an abort: a pause for      wait_for_save (the step after the abort has
      migration): name every unsaved full block    no forward pass): copy them from the
      and the partial tail, keep the blocks        registered tensors; get_finished: release
      (delay_free) until the worker role copied    the blocks once copied
      them; commit the engine's token list; a
      request with no KV computed (still
      waiting) gets its record marked instead
    request_finished (max_tokens reached):       wait_for_save: commit it, best effort
      commit the engine's whole token list

A migration target warms staged blocks into vLLM's cache before the pause: a one-token
request marked ``warm`` loads them like a resume (from staging) and saves nothing; vLLM's
prefix cache (salted per request, see Engine._prompt) then hands them to the resume, whose
`get_num_new_matched_tokens` sees them as already computed and loads only the rest.

A pause must leave the store consistent with the cache at the iteration boundary, so the
connector commits the token list the engine core holds (the client's stream may lag a step
behind it; Resume delivers committed tokens the client never saw). The scheduler cannot tell
a pause from a cancel (both are aborts): it saves on every abort, and a cancelled request's
keys are deleted by its finish anyway. Policy ``lazy`` saves nothing before that abort,
``eager`` only the tail and the blocks not yet saved; ``off`` never saves KV.

Block identity is the store's hash chain over the token ids and the model fingerprint, so the
scheduler role (which has every request's token ids) names each block by its hash; the worker
role only copies bytes. Everything is best effort: Redis trouble costs recompute, never a
wrong token or a stalled step.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from context_daemon.flush_planner import FlushKind, LinkEstimate, PendingWork, plan_flush
from context_daemon.store import (
    BlockRejected,
    KVBlock,
    KVFormat,
    RedisStore,
    RejectReason,
    StoreConfig,
    StoreUnavailable,
    TokenCommit,
    block_hashes,
    block_reads,
    tail_hash,
)
from context_daemon.store.block_codec import Buffer, decode_block, header_bytes
from context_daemon.store.block_refs import BlockRead
from worker.constants import (
    FLUSH_ASSUMED_BYTES_PER_SECOND,
    FLUSH_ASSUMED_ROUND_TRIP_SECONDS,
    KV_PARAM_FIRST_INDEX,
    KV_PARAM_REQUEST_ID,
    KV_PARAM_RESUME,
    KV_PARAM_WARM,
    KV_WRITE_QUEUE_BLOCKS,
    SPOT_CONNECTOR_CLASS,
    SPOT_CONNECTOR_MODULE,
)
from worker.kv_block_writer import KVBlockWriter, PendingBlock
from worker.kv_layout import (
    check_tensors,
    copy_block,
    geometry_for,
    kv_format_for,
    layer_names,
    load_block,
)
from worker.kv_staging import read_staged
from worker.persist_stats import (
    CACHED_BLOCKS,
    DROPPED_BLOCKS,
    LOADED_STAGED_BLOCKS,
    LOADED_STORE_BLOCKS,
    WRITTEN_BLOCKS,
    WRITTEN_BYTES,
    PersistReporter,
    PersistStats,
    persist_stats_from,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

WRITER_CLOSE_SECONDS = 5.0
# A stored tail for other tokens than asked is one a later pause will overwrite, not damage.
_STALE_TAIL_REASONS = frozenset(
    {RejectReason.MISSING, RejectReason.PREFIX_HASH, RejectReason.GEOMETRY}
)


def connector_config(
    store: StoreConfig, model_fingerprint: str, policy: str, staging_dir: str = ""
) -> dict[str, Any]:
    """The `kv_transfer_config` that makes vLLM load this connector. ``staging_dir``: where
    this worker stages prefetched blocks as a migration target (see kv_staging.py)."""
    return {
        "kv_connector": SPOT_CONNECTOR_CLASS,
        "kv_connector_module_path": SPOT_CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "store": dataclasses.asdict(store),
            "model_fingerprint": model_fingerprint,
            "policy": policy,
            "staging_dir": staging_dir,
        },
    }


@dataclass(frozen=True)
class BlockSave:
    """Copy cache slot ``block_id`` and store it as block ``block_index`` of the request;
    ``num_tokens`` > 0 makes it the partial tail. ``required``: part of a pause's flush."""

    request_id: str
    block_index: int
    block_id: int
    prefix_hash: bytes
    num_tokens: int = 0
    required: bool = False


@dataclass(frozen=True)
class BlockLoad:
    """Fill cache slot ``block_id`` with a verified stored payload."""

    block_id: int
    payload: Buffer
    staged: bool = False  # from the staging memory of a migration, not from Redis
    num_tokens: int = 0  # tokens the payload holds; below the block size: a partial tail


@dataclass
class SpotConnectorMetadata(KVConnectorMetadata):
    """What the scheduler role hands the worker role for one step."""

    saves: list[BlockSave] = field(default_factory=list)
    loads: list[BlockLoad] = field(default_factory=list)
    commits: list[TokenCommit] = field(default_factory=list)
    cached_blocks: int = 0
    """Blocks resumes found in vLLM's prefix cache since the previous step (counted only)."""
    released: list[str] = field(default_factory=list)
    """vLLM ids whose blocks may be freed once this step's saves are copied."""
    without_kv: list[str] = field(default_factory=list)
    """Our ids of paused requests of which no KV was computed: their records say so."""
    final_commits: list[TokenCommit] = field(default_factory=list)
    """Whole token lists of requests that reached their max_tokens (best effort)."""


@dataclass(frozen=True)
class _Flush:
    """What an aborted request still has to write (named at request_finished)."""

    vllm_id: str
    commit: TokenCommit | None
    saves: list[BlockSave]
    without_kv: str = ""
    """Our id when the engine had computed none of the request's KV (it had not been
    scheduled yet): nothing to save, and the record is marked so the flush counts as
    complete without blocks or tail."""


@dataclass
class _Tracked:
    """Scheduler-side state of one request that persists its KV."""

    request: Request
    request_id: str  # ours; vLLM's id carries a suffix
    resume: bool
    warm: bool = False  # a migration target's warm-up: loads only, never saves
    first_index: int = 0  # output index of the engine's first output token
    chain: list[bytes] = field(default_factory=list)  # hashes of blocks 0.. named so far
    saved_blocks: int = 0  # blocks [0, saved_blocks) are stored (saved or loaded)
    plan: _LoadPlan | None = None
    loaded_tokens: int = 0
    rejected_blocks: int = 0


@dataclass(frozen=True)
class _LoadPlan:
    first_block: int  # index of the first block to load (the local hit ends before it)
    blocks: list[KVBlock]
    matched_tokens: int  # tokens beyond the local hit whose KV the blocks hold
    staged: int = 0  # how many of ``blocks`` (the leading ones) came from staging memory


class SpotKVConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        from vllm.platforms import current_platform

        extra = self._kv_transfer_config
        self._policy = str(extra.get_from_extra_config("policy", "eager"))
        device_type = str(current_platform.device_type)
        self._geometry = geometry_for(kv_cache_config, device_type)
        self._kv_format: KVFormat = kv_format_for(
            kv_cache_config,
            str(extra.get_from_extra_config("model_fingerprint", "")),
            device_type,
            self._geometry,
        )
        self._header_bytes = header_bytes(self._kv_format)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._layer_names = layer_names(kv_cache_config)
        self._store = RedisStore.from_config(
            StoreConfig(**dict(extra.get_from_extra_config("store", {})))
        )
        staging_dir = str(extra.get_from_extra_config("staging_dir", ""))
        self._staging_root = Path(staging_dir) if staging_dir else None
        # scheduler role
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[BlockLoad] = []
        self._flushes: list[_Flush] = []
        self._final_commits: list[TokenCommit] = []
        self._cached_blocks = 0
        # worker role
        self._tensors: list[torch.Tensor] = []
        self._released: set[str] = set()
        self._loaded_staged = 0
        self._loaded_from_store = 0
        self._found_cached = 0
        self._writer: KVBlockWriter | None = None
        if role == KVConnectorRole.WORKER:
            self._writer = KVBlockWriter(self._store, self._kv_format, KV_WRITE_QUEUE_BLOCKS)
        self._persist_reporter = PersistReporter()

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save lost to preemption is a future recompute, not an error.
        return False

    # ==== scheduler role ======================================================================

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
            )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tracked = self._tracked.get(request.request_id)
        if tracked is None or not tracked.resume:
            return 0, False
        if tracked.plan is None:
            if not tracked.warm:  # found warmed by the handshake (or left by an earlier run)
                self._cached_blocks += num_computed_tokens // self._kv_format.block_tokens
            tracked.plan = self._plan_load(tracked, num_computed_tokens)
        return tracked.plan.matched_tokens, False

    def _plan_load(self, tracked: _Tracked, num_computed_tokens: int) -> _LoadPlan:
        """Read the request's full blocks and its partial tail (a pause stored one), keep the
        verified leading run, cap as vLLM requires."""
        block_tokens = self._kv_format.block_tokens
        first_block = num_computed_tokens // block_tokens
        token_ids = list(tracked.request.all_token_ids)
        reads = block_reads(tracked.request_id, self._kv_format, token_ids, include_tail=False)
        reads = reads[first_block:]
        # The tail a pause stores holds every token but the last (vLLM computes that one); it
        # follows the full blocks, or stands in for the last one when that never filled.
        tail = None
        if (len(token_ids) - 1) % block_tokens:
            kv_reads = block_reads(tracked.request_id, self._kv_format, token_ids[:-1])
            if kv_reads[-1].block_index >= first_block:
                tail = kv_reads[-1]
        try:
            wanted = reads + ([tail] if tail is not None else [])
            loaded, staged = self._load(wanted)
        except StoreUnavailable as exc:
            log.warning(
                "resume of %s: Redis unavailable, recomputing (%s)", tracked.request_id, exc
            )
            return _LoadPlan(first_block, [], 0)
        usable: list[KVBlock] = []
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
        stored = sum(block.num_tokens for block in usable)
        end = min(first_block * block_tokens + stored, len(token_ids) - 1)
        matched = max(0, end - num_computed_tokens)
        if not matched:
            return _LoadPlan(first_block, [], 0)
        return _LoadPlan(first_block, usable, matched, sum(staged[: len(usable)]))

    def _load(self, wanted: list[BlockRead]) -> tuple[list[KVBlock | BlockRejected], list[bool]]:
        """``wanted`` blocks, from the staging memory where a migration prefetched them
        (verified like a store read), the rest from Redis in one round trip; with, per block,
        whether it came from staging."""
        loaded: list[KVBlock | BlockRejected | None] = [None] * len(wanted)
        if self._staging_root is not None:
            for position, read in enumerate(wanted):
                if not read.is_full:
                    continue
                data = read_staged(self._staging_root, read.prefix_hash)
                if data is None:
                    continue
                try:
                    loaded[position] = decode_block(
                        read.name, data, self._kv_format, read.prefix_hash, read.num_tokens
                    )
                except BlockRejected as rejected:
                    log.warning("staged %s; reading it from the store instead", rejected)
        missing = [position for position, block in enumerate(loaded) if block is None]
        if missing:
            fetched = self._store.get_blocks([wanted[p] for p in missing], self._kv_format)
            for position, block in zip(missing, fetched, strict=True):
                loaded[position] = block
        from_store = set(missing)
        staged = [position not in from_store for position in range(len(wanted))]
        return [block for block in loaded if block is not None], staged

    def _count_rejected(
        self, tracked: _Tracked, block: BlockRejected, *harmless: RejectReason
    ) -> None:
        """A block that cannot be used: count and log it, unless its reason is ``harmless``
        (absent, or a tail from an earlier pause that a later one will overwrite)."""
        if block.reason in harmless:
            return
        tracked.rejected_blocks += 1
        log.warning("resume of %s: %s; its tokens are recomputed", tracked.request_id, block)

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
        for offset, block in enumerate(plan.blocks):
            self._loads.append(
                BlockLoad(
                    block_ids[plan.first_block + offset],
                    block.payload,
                    offset < plan.staged,
                    block.num_tokens,
                )
            )
        # A loaded tail is not a saved block: once full it must be saved like any other.
        full = [block for block in plan.blocks if block.is_full]
        tracked.chain = [block.prefix_hash for block in full]
        if plan.first_block:
            tracked.chain = block_hashes(
                self._kv_format.model_fingerprint,
                list(request.all_token_ids),
                self._kv_format.block_tokens,
            )[: plan.first_block + len(full)]
        tracked.saved_blocks = plan.first_block + len(full)
        tracked.loaded_tokens = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = SpotConnectorMetadata(loads=self._loads, cached_blocks=self._cached_blocks)
        self._loads, self._cached_blocks = [], 0
        if self._flushes:
            self._add_flushes(meta, self._flushes)
            self._flushes = []
        meta.final_commits, self._final_commits = self._final_commits, []
        if self._policy != "eager":
            return meta
        block_state = scheduler_output.kv_connector_block_state
        for vllm_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(vllm_id)
            if tracked is None or tracked.warm or block_state is None:
                continue
            # The worker role saves after this step's forward pass, so every block that is
            # full once this step's tokens are computed can go now.
            full_blocks = (tracked.request.num_computed_tokens + scheduled) // (
                self._kv_format.block_tokens
            )
            if full_blocks <= tracked.saved_blocks:
                continue
            ids = block_state.get_block_ids(vllm_id)
            if ids is None:
                continue
            meta.saves.extend(self._name_new_blocks(tracked, full_blocks, ids[0]))
        return meta

    def _name_new_blocks(
        self, tracked: _Tracked, full_blocks: int, block_ids: list[int]
    ) -> list[BlockSave]:
        block_tokens = self._kv_format.block_tokens
        token_ids = tracked.request.all_token_ids
        full_blocks = min(full_blocks, len(token_ids) // block_tokens, len(block_ids))
        if len(tracked.chain) < full_blocks:
            tracked.chain = block_hashes(
                self._kv_format.model_fingerprint,
                list(token_ids[: full_blocks * block_tokens]),
                block_tokens,
            )
        saves = [
            BlockSave(tracked.request_id, index, block_ids[index], tracked.chain[index])
            for index in range(tracked.saved_blocks, full_blocks)
        ]
        tracked.saved_blocks = max(tracked.saved_blocks, full_blocks)
        return saves

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus as VllmRequestStatus

        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        delay_free = False
        aborted = request.status == VllmRequestStatus.FINISHED_ABORTED
        if aborted and self._policy != "off" and not tracked.warm:
            flush = self._name_flush(tracked, block_ids)
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
        }

    def _name_flush(self, tracked: _Tracked, block_ids: list[int]) -> _Flush:
        """Everything of a paused request not in the store yet: its tokens (as the engine has
        them), the full blocks not saved so far and the partial tail."""
        request = tracked.request
        block_tokens = self._kv_format.block_tokens
        token_ids = list(request.all_token_ids)
        # A step may be in flight at the abort (its token never reached the output); the KV
        # a standby needs is that of every token but the last, which it computes itself.
        computed = min(
            request.num_computed_tokens, len(token_ids) - 1, len(block_ids) * block_tokens
        )
        full_blocks = computed // block_tokens
        if len(tracked.chain) < full_blocks:
            tracked.chain = block_hashes(
                self._kv_format.model_fingerprint,
                token_ids[: full_blocks * block_tokens],
                block_tokens,
            )
        saves = [
            BlockSave(
                tracked.request_id, index, block_ids[index], tracked.chain[index], required=True
            )
            for index in range(tracked.saved_blocks, full_blocks)
        ]
        tail_tokens = computed - full_blocks * block_tokens
        if tail_tokens:
            prefix = tail_hash(
                self._kv_format.model_fingerprint, token_ids[:computed], block_tokens
            )
            assert prefix is not None
            saves.append(
                BlockSave(
                    tracked.request_id,
                    full_blocks,
                    block_ids[full_blocks],
                    prefix,
                    num_tokens=tail_tokens,
                    required=True,
                )
            )
        tracked.saved_blocks = full_blocks
        outputs = tuple(request.output_token_ids)
        commit = TokenCommit(tracked.request_id, tracked.first_index, outputs) if outputs else None
        return _Flush(request.request_id, commit, saves, "" if computed else tracked.request_id)

    def _add_flushes(self, meta: SpotConnectorMetadata, flushes: list[_Flush]) -> None:
        """Queue the flushes in the planner's order: every token list first, then the KV of
        the requests with the least of it (the most requests complete soonest)."""
        block_bytes = self._kv_format.layer_count * self._block_bytes_per_layer()
        by_id = {flush.vllm_id: flush for flush in flushes}
        plan = plan_flush(
            [
                PendingWork(
                    flush.vllm_id,
                    len(flush.commit.token_ids) if flush.commit else 0,
                    len(flush.saves) * block_bytes,
                )
                for flush in flushes
            ],
            LinkEstimate(FLUSH_ASSUMED_BYTES_PER_SECOND, FLUSH_ASSUMED_ROUND_TRIP_SECONDS),
            seconds_left=float("inf"),
        )
        meta.commits.extend(flush.commit for flush in flushes if flush.commit is not None)
        for step in plan.steps:
            if step.kind is FlushKind.KV:
                meta.saves.extend(by_id[step.request_id].saves)
        meta.released.extend(flush.vllm_id for flush in flushes if flush.saves)
        meta.without_kv.extend(flush.without_kv for flush in flushes if flush.without_kv)

    def _block_bytes_per_layer(self) -> int:
        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        return int(getattr(spec, "page_size_bytes", 1))

    # ==== worker role =========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors = [kv_caches[name] for name in self._layer_names]
        check_tensors(tensors, self._num_blocks, self._kv_format)
        self._tensors = tensors

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, SpotConnectorMetadata)
        self._found_cached += meta.cached_blocks
        for load in meta.loads:
            load_block(self._tensors, load.block_id, load.payload, self._geometry, load.num_tokens)
            if load.staged:
                self._loaded_staged += 1
            else:
                self._loaded_from_store += 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv fills every layer before the forward pass

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # whole blocks, all layers at once, in wait_for_save

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata() or self._writer is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, SpotConnectorMetadata)
        for commit in meta.commits:
            self._writer.submit_tokens(commit)
        for save in meta.saves:
            self._writer.submit(
                PendingBlock(
                    request_id=save.request_id,
                    block_index=save.block_index,
                    prefix_hash=save.prefix_hash,
                    data=copy_block(
                        self._tensors,
                        save.block_id,
                        self._header_bytes,
                        self._geometry,
                        save.num_tokens,
                    ),
                    num_tokens=save.num_tokens,
                ),
                required=save.required,
            )
        for request_id in meta.without_kv:
            self._writer.submit_no_kv(request_id)
        for commit in meta.final_commits:
            self._writer.submit_tokens(commit, final=True)
        # The copies are private: the cache slots may be freed now.
        self._released.update(meta.released)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self._released:
            return None, None
        released, self._released = self._released, set()
        return released, None

    def get_kv_connector_stats(self) -> PersistStats | None:
        """What the writer persisted since the last call (the worker's metrics add it up)."""
        if self._writer is None:
            return None
        return self._persist_reporter.report(
            {
                WRITTEN_BLOCKS: self._writer.written_blocks,
                WRITTEN_BYTES: self._writer.written_bytes,
                DROPPED_BLOCKS: self._writer.dropped_blocks,
                LOADED_STAGED_BLOCKS: self._loaded_staged,
                LOADED_STORE_BLOCKS: self._loaded_from_store,
                CACHED_BLOCKS: self._found_cached,
            }
        )

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PersistStats | None:
        return persist_stats_from(data)

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.close(WRITER_CLOSE_SECONDS)
        self._store.close()
