"""The one way a test waits for something to become true: `wait_until` (threads, processes)
and `wait_until_async` (inside an event loop). Both poll ``predicate`` every ``interval``
seconds and, if it is still false after ``timeout`` seconds, fail the test with ``message``
(a string, or a function of no argument that tells the state at that moment).

A wait is for something that must happen. A test that something does *not* happen uses an
event or an injected clock instead (tests/support/clock.py): a fixed sleep before such an
assertion passes whenever the machine is slow.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

DEFAULT_TIMEOUT_SECONDS = 120.0
DEFAULT_INTERVAL_SECONDS = 0.02


def wait_until(
    predicate: Callable[[], object],
    message: str | Callable[[], str] = "the condition",
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    interval: float = DEFAULT_INTERVAL_SECONDS,
) -> None:
    """Returns once ``predicate()`` is truthy; raises AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(_timed_out(timeout, message))
        time.sleep(interval)


async def wait_until_async(
    predicate: Callable[[], object],
    message: str | Callable[[], str] = "the condition",
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    interval: float = DEFAULT_INTERVAL_SECONDS,
) -> None:
    """`wait_until` that yields to the event loop between polls (``predicate`` runs on the
    loop: keep it cheap, or poll through ``asyncio.to_thread`` inside it)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(_timed_out(timeout, message))
        await asyncio.sleep(interval)


def _timed_out(timeout: float, message: str | Callable[[], str]) -> str:
    what = message() if callable(message) else message
    return f"timed out after {timeout:.1f} s waiting for: {what}"
