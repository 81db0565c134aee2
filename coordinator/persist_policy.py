"""The cluster's KV persistence policy, as its workers report it.

Each worker says in its Stats (and in the capacity its registration carries) which KV blocks
it writes to Redis: ``eager``, ``lazy``, ``hybrid`` with its rate cap, or ``off``. A cluster
is meant to run one policy: what an abrupt loss costs, and what a notice has to move in its
grace, are planned per cluster. Workers that disagree (a half-rolled-out config change, a
worker started by hand) still serve, but the operator is told: a warning in the log when it
starts (and a line when they agree again), in `spotinfer status` and in the metrics.

Workers that are gone (LOST, STOPPED) and workers that report no policy (a release before
this field, or no heartbeat answered yet) do not count.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from common.messages import KvPersistence
from coordinator.registry import WorkerEntry, WorkerState

log = logging.getLogger(__name__)

_GONE = frozenset({WorkerState.LOST, WorkerState.STOPPED})


@dataclass(frozen=True)
class ClusterPersistence:
    """``agreed``: the policy every counted worker applies (policy "" when none reports one,
    or when they disagree); ``workers``: worker ids by the policy they apply."""

    agreed: KvPersistence
    workers: dict[KvPersistence, list[str]] = field(default_factory=dict)

    @property
    def warning(self) -> str:
        """Why the workers' policies need a look; "" when they agree."""
        if len(self.workers) < 2:
            return ""
        groups = "; ".join(
            f"{persistence.label}: {', '.join(ids)}"
            for persistence, ids in sorted(self.workers.items(), key=lambda item: item[0].label)
        )
        return f"the workers disagree on the KV persistence policy ({groups})"


def cluster_persistence(entries: Iterable[WorkerEntry]) -> ClusterPersistence:
    workers: dict[KvPersistence, list[str]] = {}
    for entry in entries:
        if entry.state in _GONE or entry.capacity is None:
            continue
        persistence = entry.capacity.kv_persistence
        if persistence.policy:
            workers.setdefault(persistence, []).append(entry.worker_id)
    agreed = next(iter(workers)) if len(workers) == 1 else KvPersistence()
    return ClusterPersistence(agreed, workers)


class PersistPolicyWatch:
    """Logs when the workers start to disagree, or their disagreement changes (a warning),
    and when they agree again."""

    def __init__(self) -> None:
        self._warned = ""

    def check(self, entries: Iterable[WorkerEntry]) -> ClusterPersistence:
        persistence = cluster_persistence(entries)
        warning = persistence.warning
        if warning and warning != self._warned:
            log.warning("%s", warning)
        elif self._warned and not warning:
            log.info(
                "the workers agree on the KV persistence policy again: %s",
                persistence.agreed.label,
            )
        self._warned = warning
        return persistence
