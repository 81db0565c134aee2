"""How long the Python client waits before it tries a call again.

A server that refuses for now says when to come back (trailing metadata ``retry-after-ms``:
a full queue, no worker within the coordinator's capacity wait, an API key over its rate).
The client waits at least that long, plus up to as long again at random, so that a crowd of
clients refused together does not come back together. Without a hint (a broken connection,
a coordinator restarting) it waits with exponential backoff and full jitter: a random time
up to ``base * 2**(attempt - 1)``, at most ``max_seconds``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import grpc

from common.errors import RETRY_AFTER_METADATA_KEY


@dataclass(frozen=True)
class Backoff:
    base_seconds: float
    max_seconds: float

    def __post_init__(self) -> None:
        if not 0 < self.base_seconds <= self.max_seconds or not math.isfinite(self.max_seconds):
            raise ValueError(
                "the backoff needs 0 < base_seconds <= max_seconds (finite), got "
                f"{self.base_seconds} and {self.max_seconds}"
            )

    def delay_seconds(self, attempt: int, hint_seconds: float | None, rng: random.Random) -> float:
        """The wait before try ``attempt`` + 1 (``attempt`` counts from 1). A hint is never cut
        short: ``max_seconds`` bounds only the jitter added to it."""
        if hint_seconds is not None and hint_seconds > 0:
            jitter = rng.uniform(0, hint_seconds)
            return hint_seconds + min(jitter, max(0.0, self.max_seconds - hint_seconds))
        ceiling = min(self.max_seconds, self.base_seconds * 2 ** min(attempt - 1, 62))
        return rng.uniform(0, ceiling)


def retry_hint_seconds(error: grpc.RpcError) -> float | None:
    """The server's ``retry-after-ms`` in seconds; None when it gave none (or a bad one)."""
    trailing = getattr(error, "trailing_metadata", None)
    metadata = trailing() if callable(trailing) else None
    for key, value in metadata or ():
        if key == RETRY_AFTER_METADATA_KEY:
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                return None
    return None
