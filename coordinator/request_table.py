"""Every request this coordinator relays, by id: in flight, and finished ones for the
retention window (a client whose connection dropped at the end can still attach)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from coordinator.errors import UnknownRequest
from coordinator.relay import Relay


class RequestTable:
    def __init__(self, retention_seconds: float, clock: Callable[[], float] = time.monotonic):
        self._retention_seconds = retention_seconds
        self._clock = clock
        self._relays: dict[str, Relay] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._relays

    def __iter__(self) -> Iterator[Relay]:
        return iter(list(self._relays.values()))

    def add(self, relay: Relay) -> None:
        assert relay.request_id not in self._relays
        self._relays[relay.request_id] = relay

    def get(self, request_id: str) -> Relay:
        relay = self._relays.get(request_id)
        if relay is None:
            raise UnknownRequest(request_id)
        return relay

    def forget(self, request_id: str) -> None:
        """Drops a finished request at once (one that never ran: its id may be used again)."""
        relay = self._relays.get(request_id)
        assert relay is None or relay.finished
        self._relays.pop(request_id, None)

    @property
    def in_flight(self) -> int:
        return sum(1 for relay in self._relays.values() if not relay.finished)

    def on_worker(self, address: str) -> list[Relay]:
        """Unfinished requests served by the worker at ``address``."""
        return [
            relay
            for relay in self._relays.values()
            if not relay.finished
            and relay.lease is not None
            and relay.lease.entry.address == address
        ]

    def sweep(self) -> int:
        """Forgets finished requests older than the retention window; returns how many."""
        now = self._clock()
        expired = [
            request_id
            for request_id, relay in self._relays.items()
            if relay.finished_monotonic is not None
            and now - relay.finished_monotonic > self._retention_seconds
        ]
        for request_id in expired:
            del self._relays[request_id]
        return len(expired)
