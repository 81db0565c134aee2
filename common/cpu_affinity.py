"""Threads that move bytes off the compute cores.

vLLM-CPU binds each rank's process to its cores (``VLLM_CPU_OMP_THREADS_BIND``): the OpenMP
runtime pins the rank's main thread when torch loads, and every thread that process starts
later inherits that mask. A rank's KV writer, loader or landing thread would then share its
one core with the forward pass it is meant to stay out of the way of; on a two-rank,
two-core worker a rank's eager save of a chunk waited behind the rank's own steps for up to
the rest of the request. Such a thread calls `unpin_current_thread` first: it may run on any
CPU the process's cgroup allows, and the kernel places it where there is room.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def unpin_current_thread() -> set[int]:
    """Widen the calling thread's CPU mask to every CPU (the kernel keeps it inside the
    cgroup's set); returns the mask it ends with. A failure is logged and changes nothing."""
    if not hasattr(os, "sched_setaffinity"):
        return set()
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
        return os.sched_getaffinity(0)
    except OSError as exc:
        log.debug("thread CPU mask left as it was: %s", exc)
        return os.sched_getaffinity(0)
