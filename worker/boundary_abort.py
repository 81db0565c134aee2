"""Aborting requests in vLLM's engine core between two steps, not inside one.

`AsyncLLM.abort` takes a request out of the output processor at once, and the engine core
takes the abort eagerly: it drops the request before the step in flight reports, so that
step's token — computed, its KV written — is thrown away, and a pause costs the client a
decode step. Sent as a utility call instead, the abort waits in the core's input queue
until the step has ended and its outputs are sent; the token reaches the stream first::

    eager:    step k+1 ─┬─ abort (drops token k+1) ─▶ flush       client: ... k │ pause
    boundary: step k+1 ─┴─▶ outputs (token k+1) ─▶ abort ─▶ flush  client: ... k, k+1 │ pause

Either way the connector flushes the request at the same moment (after the step); the
boundary abort only keeps its token. A token the stream still misses (the output handler had
not pushed it when the caller's plain abort closed the stream) is committed by the
connector's flush, and a resume sends it first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

UTILITY_TIMEOUT_SECONDS = 5.0
"""Longest wait for the core to take the abort: a step ends well within it. Past it (a hung
or dead core), the caller's plain abort goes out anyway; the late utility call is harmless
(an abort of a finished request does nothing)."""

_DRAIN_ROUNDS = 1000
"""Event-loop turns to wait for the output handler to take the step's outputs (each turn is
microseconds; a backlog of 1000 outputs means something else is wrong)."""


async def abort_at_step_boundary(llm: Any, request_ids: Sequence[str]) -> bool:
    """Aborts ``request_ids`` (the caller's ids) in ``llm``'s engine core at the end of the
    step in flight, and returns once the outputs that step sent are in the request streams.
    False when nothing was done (none of the ids is running, or this vLLM lacks the parts
    it needs): the caller's plain abort then does the work. The caller aborts the requests
    with `AsyncLLM.abort` afterwards in any case, which ends their streams."""
    core = getattr(llm, "engine_core", None)
    by_external_id = getattr(getattr(llm, "output_processor", None), "external_req_ids", None)
    if core is None or by_external_id is None:
        return False
    internal_ids = [
        internal for request_id in request_ids for internal in by_external_id.get(request_id, ())
    ]
    if not internal_ids:
        return False
    try:
        await asyncio.wait_for(
            core.call_utility_async("abort_requests", internal_ids), UTILITY_TIMEOUT_SECONDS
        )
    except Exception as exc:  # an engine without the utility: the plain abort still works
        log.warning("abort at a step boundary failed (%r); aborting eagerly", exc)
        return False
    # The core sent the step's outputs before the utility's reply; the client read them in
    # that order, but the output handler may not have taken them from its queue yet.
    outputs = getattr(core, "outputs_queue", None)
    for _ in range(_DRAIN_ROUNDS):
        if outputs is None or outputs.empty():
            break
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    return True
