"""What the parts of the worker's engine (streams, resumption, preemption) share: the config,
the store and staging memory, and, once the model is loaded, vLLM's engine and its limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.validation import Limits
from store import RedisStore
from worker.config import WorkerConfig
from worker.engine_builder import EngineShape
from worker.engine_stats import EngineStats
from worker.errors import EngineNotReady
from worker.kv_staging import StagingArea
from worker.token_committer import TokenCommitter


@dataclass
class EngineContext:
    """Owned by the event loop that serves gRPC. ``store`` None: nothing persists, and no
    resume; ``staging`` None: no prefetch. The fields after them are set by `Engine.start`
    (``committer`` only with a store); ``llm`` is None again after `Engine.shutdown`."""

    config: WorkerConfig
    store: RedisStore | None
    staging: StagingArea | None
    llm: Any = None
    fingerprint: str = ""
    shape: EngineShape | None = None
    limits: Limits | None = None
    committer: TokenCommitter | None = None
    stats: EngineStats | None = None
    """What vLLM's stat logger reports (a resume's blocks refused by their MAC among it)."""

    def require_shape(self) -> EngineShape:
        if self.shape is None:
            raise EngineNotReady("the engine is still loading the model")
        return self.shape

    def require_limits(self) -> Limits:
        if self.limits is None:
            raise EngineNotReady("the engine is still loading the model")
        return self.limits
