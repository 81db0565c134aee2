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

Block identity is the store's hash chain over the token ids and the model fingerprint, so the
scheduler role (which has every request's token ids) names each block by its hash; the worker
role only copies bytes. Everything is best effort: Redis trouble costs recompute, never a
wrong token or a stalled step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from context_daemon.store import (
    BlockRejected,
    KVBlock,
    KVFormat,
    RedisStore,
    RejectReason,
    StoreUnavailable,
    block_hashes,
    block_reads,
)
from worker.constants import (
    KV_PARAM_REQUEST_ID,
    KV_PARAM_RESUME,
    KV_WRITE_QUEUE_BLOCKS,
    SPOT_CONNECTOR_CLASS,
    SPOT_CONNECTOR_MODULE,
)
from worker.kv_block_writer import KVBlockWriter, PendingBlock
from worker.kv_layout import check_tensors, copy_block, kv_format_for, layer_names, load_block

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


def connector_config(redis_url: str, model_fingerprint: str, policy: str) -> dict[str, Any]:
    """The `kv_transfer_config` that makes vLLM load this connector."""
    return {
        "kv_connector": SPOT_CONNECTOR_CLASS,
        "kv_connector_module_path": SPOT_CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "redis_url": redis_url,
            "model_fingerprint": model_fingerprint,
            "policy": policy,
        },
    }


@dataclass(frozen=True)
class BlockSave:
    """Copy cache slot ``block_id`` and store it as block ``block_index`` of the request."""

    request_id: str
    block_index: int
    block_id: int
    prefix_hash: bytes


@dataclass(frozen=True)
class BlockLoad:
    """Fill cache slot ``block_id`` with a verified stored payload."""

    block_id: int
    payload: bytes


@dataclass
class SpotConnectorMetadata(KVConnectorMetadata):
    """What the scheduler role hands the worker role for one step."""

    saves: list[BlockSave] = field(default_factory=list)
    loads: list[BlockLoad] = field(default_factory=list)


@dataclass
class _Tracked:
    """Scheduler-side state of one request that persists its KV."""

    request: Request
    request_id: str  # ours; vLLM's id carries a suffix
    resume: bool
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


class SpotKVConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        from vllm.platforms import current_platform

        extra = self._kv_transfer_config
        self._policy = str(extra.get_from_extra_config("policy", "eager"))
        self._kv_format: KVFormat = kv_format_for(
            kv_cache_config,
            str(extra.get_from_extra_config("model_fingerprint", "")),
            str(current_platform.device_type),
        )
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._layer_names = layer_names(kv_cache_config)
        self._store = RedisStore.from_url(str(extra.get_from_extra_config("redis_url", "")))
        # scheduler role
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[BlockLoad] = []
        # worker role
        self._tensors: list[torch.Tensor] = []
        self._writer: KVBlockWriter | None = None
        if role == KVConnectorRole.WORKER:
            self._writer = KVBlockWriter(self._store, self._kv_format, KV_WRITE_QUEUE_BLOCKS)

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
                request=request, request_id=request_id, resume=bool(params.get(KV_PARAM_RESUME))
            )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tracked = self._tracked.get(request.request_id)
        if tracked is None or not tracked.resume:
            return 0, False
        if tracked.plan is None:
            tracked.plan = self._plan_load(tracked, num_computed_tokens)
        return tracked.plan.matched_tokens, False

    def _plan_load(self, tracked: _Tracked, num_computed_tokens: int) -> _LoadPlan:
        """Read the request's full blocks, keep the verified leading run, cap as vLLM requires."""
        block_tokens = self._kv_format.block_tokens
        first_block = num_computed_tokens // block_tokens
        token_ids = list(tracked.request.all_token_ids)
        reads = block_reads(tracked.request_id, self._kv_format, token_ids, include_tail=False)
        reads = reads[first_block:]
        try:
            loaded = self._store.get_blocks(reads, self._kv_format) if reads else []
        except StoreUnavailable as exc:
            log.warning(
                "resume of %s: Redis unavailable, recomputing (%s)", tracked.request_id, exc
            )
            return _LoadPlan(first_block, [], 0)
        usable: list[KVBlock] = []
        for block in loaded:
            if isinstance(block, BlockRejected):
                if block.reason is not RejectReason.MISSING:
                    tracked.rejected_blocks += 1
                    log.warning(
                        "resume of %s: %s; its tokens are recomputed", tracked.request_id, block
                    )
                break
            usable.append(block)
        # vLLM computes at least the last prompt token itself; a count that does not end on
        # a block boundary is fine (the last loaded block is then only partly used).
        end = min((first_block + len(usable)) * block_tokens, len(token_ids) - 1)
        matched = max(0, end - num_computed_tokens)
        return _LoadPlan(first_block, usable if matched else [], matched)

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
            self._loads.append(BlockLoad(block_ids[plan.first_block + offset], block.payload))
        tracked.chain = [block.prefix_hash for block in plan.blocks]
        if plan.first_block:
            tracked.chain = block_hashes(
                self._kv_format.model_fingerprint,
                list(request.all_token_ids),
                self._kv_format.block_tokens,
            )[: plan.first_block + len(plan.blocks)]
        tracked.saved_blocks = plan.first_block + len(plan.blocks)
        tracked.loaded_tokens = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = SpotConnectorMetadata(loads=self._loads)
        self._loads = []
        if self._policy != "eager":
            return meta
        block_state = scheduler_output.kv_connector_block_state
        for vllm_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(vllm_id)
            if tracked is None or block_state is None:
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
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None or not tracked.resume:
            return False, None
        return False, {
            "spotinfer_loaded_tokens": tracked.loaded_tokens,
            "spotinfer_rejected_blocks": tracked.rejected_blocks,
        }

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
        for load in meta.loads:
            load_block(self._tensors, load.block_id, load.payload)

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
        for save in meta.saves:
            self._writer.submit(
                PendingBlock(
                    request_id=save.request_id,
                    block_index=save.block_index,
                    prefix_hash=save.prefix_hash,
                    data=copy_block(self._tensors, save.block_id),
                )
            )

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.close(WRITER_CLOSE_SECONDS)
        self._store.close()
