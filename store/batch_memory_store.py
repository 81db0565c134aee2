"""MemoryBatchStore: the BatchStore protocol in dicts, for unit tests of the job runner.

It keeps what the runner relies on: a line's result is written once (a second write is
refused and counts nothing) and a lease held by another owner is refused until it expires
(``clock``, unix seconds). It never raises StoreUnavailable: tests of an outage run against
real Redis.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping


class MemoryBatchStore:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._files: dict[str, tuple[dict[str, str], bytes]] = {}
        self._batches: dict[str, dict[str, str]] = {}
        self._created: dict[str, int] = {}
        self._active: set[str] = set()
        self._results: dict[str, dict[str, str]] = {}
        self._attempts: dict[str, dict[str, str]] = {}
        self._leases: dict[str, tuple[str, float]] = {}
        self.refused_results = 0  # second writes of a line's result (what a test inspects)

    def close(self) -> None:
        pass

    def put_file(self, file_id: str, meta: Mapping[str, str], content: bytes) -> None:
        self._files[file_id] = (dict(meta), bytes(content))

    def file_meta(self, file_id: str) -> dict[str, str] | None:
        stored = self._files.get(file_id)
        return dict(stored[0]) if stored else None

    def file_content(self, file_id: str) -> bytes | None:
        stored = self._files.get(file_id)
        return stored[1] if stored else None

    def create_batch(self, batch_id: str, fields: Mapping[str, str], created_at: int) -> None:
        self._batches[batch_id] = dict(fields)
        self._created[batch_id] = created_at
        self._active.add(batch_id)

    def batch(self, batch_id: str) -> dict[str, str] | None:
        fields = self._batches.get(batch_id)
        return dict(fields) if fields is not None else None

    def update_batch(self, batch_id: str, fields: Mapping[str, str], final: bool = False) -> None:
        self._batches.setdefault(batch_id, {}).update(fields)
        if final:
            self._active.discard(batch_id)

    def batch_ids(self) -> list[str]:
        return sorted(self._created, key=lambda b: (self._created[b], b), reverse=True)

    def active_batch_ids(self) -> list[str]:
        return sorted(self._active)

    def put_result(self, batch_id: str, custom_id: str, line: str, counter: str) -> bool:
        results = self._results.setdefault(batch_id, {})
        if custom_id in results:
            self.refused_results += 1
            return False
        results[custom_id] = line
        self.add_to_counters(batch_id, {counter: 1})
        return True

    def results(self, batch_id: str) -> dict[str, str]:
        return dict(self._results.get(batch_id, {}))

    def result_ids(self, batch_id: str) -> set[str]:
        return set(self._results.get(batch_id, {}))

    def note_attempt(self, batch_id: str, custom_id: str, attempt: str) -> None:
        self._attempts.setdefault(batch_id, {})[custom_id] = attempt

    def attempts(self, batch_id: str) -> dict[str, str]:
        return dict(self._attempts.get(batch_id, {}))

    def add_to_counters(self, batch_id: str, amounts: Mapping[str, int]) -> None:
        fields = self._batches.setdefault(batch_id, {})
        for name, amount in amounts.items():
            fields[name] = str(int(fields.get(name, "0")) + amount)

    def take_lease(self, batch_id: str, owner: str, ttl_ms: int) -> bool:
        now = self._clock()
        holder = self._leases.get(batch_id)
        if holder is not None and holder[0] != owner and holder[1] > now:
            return False
        self._leases[batch_id] = (owner, now + ttl_ms / 1000)
        return True
