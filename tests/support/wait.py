"""The one way a test waits for something to become true: `wait_until` (threads, processes)
and `wait_until_async` (inside an event loop). Both poll ``predicate`` every ``interval``
seconds and fail the test with ``message`` (and how long it waited) at ``timeout``.

A wait is for something that must happen. A test that something does *not* happen uses an
event or an injected clock instead (see tests/support/clock.py): a fixed sleep before such
an assertion passes whenever the machine is slow.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

DEFAULT_TIMEOUT_SECONDS = 60.0
DEFAULT_INTERVAL_SECONDS = 0.02


def wait_until(
    predicate: Callable[[], object],
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    interval: float = DEFAULT_INTERVAL_SECONDS,
    message: str = "the condition",
) -> None:
    """Returns once ``predicate()`` is truthy; raises AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.1f} s waiting for: {message}")
        time.sleep(interval)


async def wait_until_async(
    predicate: Callable[[], object],
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    interval: float = DEFAULT_INTERVAL_SECONDS,
    message: str = "the condition",
) -> None:
    """`wait_until` that yields to the event loop between polls (``predicate`` runs on the
    loop: keep it cheap, or wrap blocking calls in ``asyncio.to_thread`` yourself)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.1f} s waiting for: {message}")
        await asyncio.sleep(interval)
