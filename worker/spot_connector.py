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
      became full this step (policy eager; under   cache and hand them to the writer thread
      hybrid as many as its rate cap grants)
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
prefix cache (salted per request, see RequestStreams.prompt) then hands them to the resume,
whose `get_num_new_matched_tokens` sees them as already computed and loads only the rest.

A pause must leave the store consistent with the cache at the iteration boundary, so the
connector commits the token list the engine core holds (the client's stream may lag a step
behind it; Resume delivers committed tokens the client never saw). The scheduler cannot tell
a pause from a cancel (both are aborts): it saves on every abort, and a cancelled request's
keys are deleted by its finish anyway. Policy ``lazy`` saves nothing before that abort,
``eager`` only the tail and the blocks not yet saved; ``hybrid`` saves blocks as they fill up
to a rate cap (persist_rate_cap.py), and at the abort whatever the cap held back and the
tail; ``off`` never saves KV.

Block identity is the store's hash chain over the token ids and the model fingerprint, so the
scheduler role (which has every request's token ids) names each block by its hash; the worker
role only copies bytes. Everything is best effort: Redis trouble costs recompute, never a
wrong token or a stalled step.

As in vLLM's own connectors, the class vLLM loads is a thin facade: each role's instance
holds its half (``connector_scheduler``: spot_connector_scheduler.py, ``connector_worker``:
spot_connector_worker.py) and each method of the base class goes to the half that owns it;
what passes between them each step is spot_connector_metadata.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from store import (
    RedisStore,
    StoreConfig,
)
from store.keys import shard_suffix
from worker.constants import (
    DEFAULT_KV_CHUNK_TOKENS,
    SPOT_CONNECTOR_CLASS,
    SPOT_CONNECTOR_MODULE,
)
from worker.kv_fetcher import KVFetcher
from worker.kv_layout import (
    ParallelPlace,
    copier_for,
    kv_format_for,
    parallel_place,
)
from worker.persist_stats import (
    PersistStats,
    persist_stats_from,
)
from worker.spot_connector_metadata import SpotConnectorMetadata
from worker.spot_connector_scheduler import SpotConnectorScheduler
from worker.spot_connector_worker import SpotConnectorWorker
from worker.vllm_version import check_vllm_version

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def connector_config(
    store: StoreConfig,
    model_fingerprint: str,
    policy: str,
    staging_dir: str = "",
    chunk_tokens: int = DEFAULT_KV_CHUNK_TOKENS,
    allow_other_vllm: bool = False,
    kv_load: str = "async",
    rate_cap_bytes_per_second: float = 0.0,
    handoff_socket: str = "",
    peer_staging_dir: str = "",
) -> dict[str, Any]:
    """The `kv_transfer_config` that makes vLLM load this connector. ``policy``: one of
    KV_PERSIST_POLICIES; ``staging_dir``: where this worker stages prefetched blocks as a
    migration target (see kv_staging.py); ``chunk_tokens``: tokens of KV per stored value (a
    multiple of vLLM's block size); ``allow_other_vllm``: load even on a vLLM outside
    SUPPORTED_VLLM_LINE; ``kv_load``: how a resume reads its stored KV (see KV_LOAD_MODES);
    ``rate_cap_bytes_per_second``: hybrid's cap (0 under the other policies);
    ``handoff_socket``: the node's context daemon takes the writes there (store/handoff.py;
    empty: each rank writes Redis itself); ``peer_staging_dir``: where the node's daemon puts
    the KV a peer daemon pushed for a migration to this worker (empty: none)."""
    return {
        "kv_connector": SPOT_CONNECTOR_CLASS,
        "kv_connector_module_path": SPOT_CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "store": dataclasses.asdict(store),
            "model_fingerprint": model_fingerprint,
            "policy": policy,
            "staging_dir": staging_dir,
            "chunk_tokens": chunk_tokens,
            "allow_other_vllm": allow_other_vllm,
            "kv_load": kv_load,
            "rate_cap_bytes_per_second": rate_cap_bytes_per_second,
            "handoff_socket": handoff_socket,
            "peer_staging_dir": peer_staging_dir,
        },
    }


def _dir_or_none(path: object) -> Path | None:
    return Path(str(path)) if path else None


def _loads_refused(place: ParallelPlace) -> str:
    """Why this worker's resumes recompute rather than load: a pipeline stage holds other
    layers than the scheduler role's format names (tensor-parallel shards load, each rank
    its own)."""
    if place.pp_size == 1:
        return ""
    return (
        f"pipeline parallel size {place.pp_size}: stored KV is loaded by workers of one "
        "pipeline stage only (each stage's shard is stored, not loaded)"
    )


class SpotKVConnector(KVConnectorBase_V1):
    """What vLLM loads by name (see `connector_config`): one instance per role, holding that
    role's half and handing each call to it."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        import vllm
        from vllm.platforms import current_platform

        extra = vllm_config.kv_transfer_config
        assert extra is not None, "vLLM builds a connector only from a kv_transfer_config"
        check_vllm_version(
            str(vllm.__version__), bool(extra.get_from_extra_config("allow_other_vllm", False))
        )
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        policy = str(extra.get_from_extra_config("policy", "eager"))
        device_type = str(current_platform.device_type)
        place = parallel_place(vllm_config, with_ranks=role == KVConnectorRole.WORKER)
        copier = copier_for(kv_cache_config, vllm_config, device_type, place)
        fingerprint = str(extra.get_from_extra_config("model_fingerprint", ""))
        chunk_tokens = int(extra.get_from_extra_config("chunk_tokens", DEFAULT_KV_CHUNK_TOKENS))
        kv_format = dataclasses.replace(
            kv_format_for(kv_cache_config, fingerprint, copier, chunk_tokens),
            shard=shard_suffix(place.tp_rank, place.pp_rank),
        )
        store_config = StoreConfig(**dict(extra.get_from_extra_config("store", {})))
        store = RedisStore.from_config(store_config)
        staging_dir = str(extra.get_from_extra_config("staging_dir", ""))
        self.connector_scheduler: SpotConnectorScheduler | None = None
        self.connector_worker: SpotConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = SpotConnectorScheduler(
                kv_cache_config,
                kv_format,
                policy,
                store,
                Path(staging_dir) if staging_dir else None,
                _loads_refused(place),
                str(extra.get_from_extra_config("kv_load", "async")),
                # Rank 0's format is this role's own; the others differ in the rank their
                # layout string names and in their keys' suffix.
                [
                    kv_format,
                    *(
                        dataclasses.replace(
                            kv_format_for(
                                kv_cache_config,
                                fingerprint,
                                copier_for(
                                    kv_cache_config,
                                    vllm_config,
                                    device_type,
                                    dataclasses.replace(place, tp_rank=rank),
                                ),
                                chunk_tokens,
                            ),
                            shard=shard_suffix(rank),
                        )
                        for rank in range(1, place.tp_size)
                    ),
                ],
                KVFetcher(store_config, store),
                float(extra.get_from_extra_config("rate_cap_bytes_per_second", 0.0)),
                peer_staging_root=_dir_or_none(extra.get_from_extra_config("peer_staging_dir", "")),
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = SpotConnectorWorker(
                kv_cache_config,
                kv_format,
                copier,
                store,
                place.tp_rank,
                str(extra.get_from_extra_config("handoff_socket", "")),
            )

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save lost to preemption is a future recompute, not an error.
        return False

    # ==== scheduler role ======================================================================

    def on_new_request(self, request: Request) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    # ==== worker role =========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        if self.has_connector_metadata():
            self.connector_worker.start_load_kv(self._spot_metadata())

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
        assert self.connector_worker is not None
        if self.has_connector_metadata():
            self.connector_worker.wait_for_save(self._spot_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.connector_worker is not None
        return self.connector_worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.connector_worker is not None
        return self.connector_worker.take_load_errors()

    def _spot_metadata(self) -> SpotConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SpotConnectorMetadata)
        return meta

    # ==== both roles ==========================================================================

    def get_kv_connector_stats(self) -> PersistStats | None:
        """What the worker role's writer persisted since the last call (the worker's metrics
        add it up); the scheduler role's: the blocks each resumed request had refused by
        their MAC (its MIGRATED / RECOVERED event says so) and the blocks hybrid's rate cap
        held back."""
        if self.connector_worker is None:
            if self.connector_scheduler is None:
                return None
            return self.connector_scheduler.report()
        return self.connector_worker.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PersistStats | None:
        return persist_stats_from(data)

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
