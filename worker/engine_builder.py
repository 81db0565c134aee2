"""Building the worker's vLLM engine (`AsyncLLM`) from its config: the memory plan, the
engine arguments, the spot connector's transfer config, and the shape vLLM really gave it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from common.validation import MAX_LOGPROBS
from worker.config import WorkerConfig, engine_environment
from worker.engine_stats import EngineStats
from worker.kv_staging import StagingArea
from worker.model_fingerprint import model_fingerprint
from worker.seed_continuation import SEED_CONTINUATION_CLASS


@dataclass(frozen=True)
class EngineShape:
    """What the loaded engine really got (after vLLM sized it)."""

    model: str
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    kv_blocks_total: int
    kv_block_tokens: int
    kv_cache_bytes: int
    kv_chunk_tokens: int
    """Tokens of one stored KV value (the store's unit: hash chain, flush state, staging)."""


class EngineBuilder:
    """Turns a WorkerConfig into an `AsyncLLM`. ``persist``: there is a store, so the spot
    connector goes in; ``staging``: where this worker stages a migration's blocks, if it
    does; ``stats``: the stat logger every engine step reports to."""

    def __init__(
        self,
        config: WorkerConfig,
        stats: EngineStats,
        persist: bool,
        staging: StagingArea | None,
    ) -> None:
        self.config = config
        self._stats = stats
        self._persist = persist
        self._staging = staging

    def build(self) -> tuple[Any, str]:
        """The engine and the model's fingerprint. Blocking (it loads the model): run it in a
        thread."""
        for key, value in engine_environment().items():
            os.environ.setdefault(key, value)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        fingerprint = model_fingerprint(self.config.model, self.config.dtype)
        kv_cache_bytes, max_num_seqs = self.planned_kv_and_seqs()
        if kv_cache_bytes:
            # vLLM-CPU's legacy variable would override an explicit size.
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        args = AsyncEngineArgs(
            model=self.config.model,
            dtype=self.config.dtype,  # type: ignore[arg-type]  # checked in WorkerConfig
            max_model_len=self.config.max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens or None,
            kv_cache_memory_bytes=kv_cache_bytes or None,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            tensor_parallel_size=self.config.tensor_parallel_size,
            enforce_eager=self._enforce_eager(),
            # A migration target warms the staged blocks into vLLM's prefix cache (see
            # prefetch); each request's own salt keeps others from sharing them unless
            # cross-request prefix caching is asked for.
            enable_prefix_caching=self.config.enable_prefix_caching or self._staging is not None,
            seed=self.config.seed,
            # The bound our validation enforces on a request's logprobs (vLLM's default).
            max_logprobs=MAX_LOGPROBS,
            scheduling_policy=self.config.scheduling_policy,  # type: ignore[arg-type]
            # Stats on: vLLM's per-request queued / scheduled timestamps (EngineTiming).
            disable_log_stats=False,
            # The real batch of each step (prefills + decodes) for the batch-size histogram.
            enable_logging_iteration_details=True,
            kv_transfer_config=self._kv_transfer_config(fingerprint),
            # A resumed seeded request's generator skips its earlier draws (collective_rpc
            # spot_continue_seeds, once the engine runs).
            worker_extension_cls=SEED_CONTINUATION_CLASS,
        )
        llm = AsyncLLM.from_engine_args(args, stat_loggers=[self._stats.logger_factory()])
        return llm, fingerprint

    def _kv_transfer_config(self, fingerprint: str) -> Any:
        """The spot connector, when there is a store to persist to."""
        if not self._persist:
            return None
        from vllm.config import KVTransferConfig

        from worker.spot_connector import connector_config

        staging_dir = str(self._staging.root) if self._staging is not None else ""
        return KVTransferConfig(
            **connector_config(
                self.config.store,
                fingerprint,
                self.config.kv_persist_policy,
                staging_dir,
                self.config.kv_chunk_tokens,
                self.config.allow_other_vllm,
                self.config.kv_load,
                self.config.kv_persist_rate_bytes_per_second,
                self.config.kv_handoff_socket,
                self.config.kv_peer_staging_dir,
            )
        )

    def _enforce_eager(self) -> bool:
        """As asked; unset: eager on CPU only (on GPU, CUDA graphs stay on)."""
        if self.config.enforce_eager is not None:
            return self.config.enforce_eager
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())

    def planned_kv_and_seqs(self) -> tuple[int, int]:
        """KV bytes and max_num_seqs: explicit values, or the memory planner's when
        `memory_gib` is set (max_num_seqs is then capped so peak concurrency fits)."""
        kv_cache_bytes = self.config.kv_cache_bytes
        max_num_seqs = self.config.max_num_seqs
        if self.config.memory_gib and not kv_cache_bytes:
            from worker.memory_planner import plan_for_worker

            kv_cache_bytes, fitting_seqs = plan_for_worker(
                self.config.model,
                int(self.config.memory_gib * 2**30),
                self.config.max_model_len,
                dtype=self.config.dtype,  # type: ignore[arg-type]  # checked in WorkerConfig
                tensor_parallel_size=self.config.tensor_parallel_size,
                block_tokens=_platform_block_tokens(),
            )
            max_num_seqs = min(max_num_seqs, fitting_seqs)
        return kv_cache_bytes, max_num_seqs

    def read_shape(self, llm: Any) -> EngineShape:
        """What vLLM sized the engine ``llm`` to."""
        vllm_config = llm.vllm_config
        cache = vllm_config.cache_config
        blocks = int(cache.num_gpu_blocks or 0)
        return EngineShape(
            model=self.config.model,
            max_model_len=int(vllm_config.model_config.max_model_len),
            max_num_seqs=int(vllm_config.scheduler_config.max_num_seqs),
            vocab_size=int(vllm_config.model_config.get_vocab_size()),
            kv_blocks_total=blocks,
            kv_block_tokens=int(cache.block_size),
            kv_cache_bytes=int(cache.kv_cache_memory_bytes or 0),
            kv_chunk_tokens=self.config.kv_chunk_tokens,
        )


def _platform_block_tokens() -> int:
    """vLLM's KV block size: 128 tokens on CPU, 16 on GPU."""
    from vllm.platforms import current_platform

    return 128 if current_platform.is_cpu() else 16
