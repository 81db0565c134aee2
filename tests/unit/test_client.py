"""The client's exactly-once filter: replays are trimmed by index, skips are refused."""

from __future__ import annotations

import pytest

from common.requests import Event, EventKind, FinishReason, TokenChunk
from spotinfer.client import _without_seen_tokens


def test_overlapping_replay_is_trimmed() -> None:
    chunk, delivered = _without_seen_tokens(TokenChunk("r", 2, (7, 8, 9)), delivered=4)
    assert chunk is not None and chunk.token_ids == (9,) and chunk.index == 4
    assert delivered == 5


def test_fully_seen_chunk_is_dropped_but_events_and_finish_are_kept() -> None:
    assert _without_seen_tokens(TokenChunk("r", 0, (1, 2)), delivered=2) == (None, 2)
    event = Event(EventKind.MIGRATED, from_worker="a", to_worker="b")
    chunk, _ = _without_seen_tokens(TokenChunk("r", 0, (1,), event=event), delivered=2)
    assert chunk is not None and chunk.token_ids == () and chunk.event == event
    chunk, _ = _without_seen_tokens(
        TokenChunk("r", 2, (), finish_reason=FinishReason.LENGTH), delivered=2
    )
    assert chunk is not None and chunk.finished


def test_a_gap_is_an_error_not_a_silent_loss() -> None:
    with pytest.raises(RuntimeError, match="skipped tokens 3..4"):
        _without_seen_tokens(TokenChunk("r", 5, (1,)), delivered=3)
