"""Dataclasses of the messages that cross a process boundary, beside those of a request's
path (`common.requests`). `protos/convert.py` turns each into its proto message and back."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FlushReport:
    """How far one paused request's state reached the store (the `FlushProgress` message the
    worker streams to its daemon and the daemon to the coordinator; see worker/flush_state.py)."""

    request_id: str
    complete: bool
    committed_tokens: int
    persisted_blocks: int
    tail_persisted: bool
    context_tokens: int
    worker_id: str
