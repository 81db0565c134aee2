"""Where a resume continues from: the store's tokens, extended by the client's."""

from __future__ import annotations

import pytest

from store import RequestRecord, RequestStatus
from worker.errors import CannotResume
from worker.resume_point import ResumePoint


def point(stored: tuple[int, ...], status: RequestStatus = RequestStatus.RUNNING) -> ResumePoint:
    record = RequestRecord(
        request_id="r",
        model_fingerprint="m",
        prompt_token_ids=(1, 2, 3),
        sampling_params={"max_tokens": 10, "temperature": 1.0},
        kv_block_tokens=256,
        status=status,
    )
    return ResumePoint(record=record, committed_token_ids=stored)


def test_the_clients_tokens_past_the_store_extend_the_context() -> None:
    continued = point((7, 8)).continued_from((7, 8, 9, 10))
    assert continued.committed_token_ids == (7, 8, 9, 10)
    assert continued.stored_tokens == 2, "the committer writes the two the store lacks"
    assert continued.engine_prompt == (1, 2, 3, 7, 8, 9, 10)
    assert (continued.next_index, continued.remaining_tokens) == (4, 6)


@pytest.mark.parametrize("delivered", [(), (7,), (7, 8)])
def test_a_store_that_holds_as_much_or_more_is_kept(delivered: tuple[int, ...]) -> None:
    """Tokens committed but never delivered were sampled after the same history: replayed."""
    stored = point((7, 8))
    assert stored.continued_from(delivered) is stored


def test_a_finished_request_is_replayed_as_stored() -> None:
    finished = point((7, 8), RequestStatus.FINISHED)
    assert finished.continued_from((7, 8, 9)) is finished


def test_a_store_that_disagrees_with_the_client_is_refused() -> None:
    with pytest.raises(
        CannotResume, match=r"token 1 \(8\) is not the one its client received \(5\)"
    ):
        point((7, 8)).continued_from((7, 5, 9))
