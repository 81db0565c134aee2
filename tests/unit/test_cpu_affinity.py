"""A thread started by a thread pinned to one core (as a vLLM-CPU rank's threads are)
inherits the pin; `unpin_current_thread` widens it to every CPU the process may use."""

from __future__ import annotations

import os
import threading

import pytest

from common.cpu_affinity import unpin_current_thread

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to widen a pin to"
)


def test_a_thread_born_pinned_is_unpinned() -> None:
    allowed = os.sched_getaffinity(0)
    core = min(allowed)
    seen: dict[str, set[int]] = {}

    def rank_main() -> None:  # stands in for a rank's main thread, pinned by OpenMP
        os.sched_setaffinity(0, {core})

        def writer() -> None:
            seen["inherited"] = os.sched_getaffinity(0)
            seen["after"] = unpin_current_thread()
            seen["kernel"] = os.sched_getaffinity(0)

        child = threading.Thread(target=writer)
        child.start()
        child.join()
        seen["rank"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=rank_main)
    thread.start()
    thread.join()
    assert seen["inherited"] == {core}
    assert seen["after"] == seen["kernel"] == allowed
    assert seen["rank"] == {core}  # only the calling thread changes
