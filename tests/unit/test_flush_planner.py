"""The grace-period flush order: tokens first, then the most requests' KV before the deadline."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.flush_planner import (
    DEADLINE_TOLERANCE_SECONDS,
    FlushKind,
    LinkEstimate,
    PendingWork,
    plan_flush,
)

MB = 1_000_000


def simulate(order: list[PendingWork], link: LinkEstimate, seconds_left: float) -> tuple[int, int]:
    """(tokens-safe, complete) counts when all tokens go in one batch, then KV in ``order``.

    Written independently of the planner, as a reference for what any order would achieve.
    """
    deadline = seconds_left + DEADLINE_TOLERANCE_SECONDS
    token_bytes = sum(work.token_bytes for work in order)
    any_tokens = any(work.uncommitted_tokens for work in order)
    t = link.round_trip_seconds + token_bytes / link.bytes_per_second if any_tokens else 0.0
    tokens_ok = t <= deadline
    safe = len(order) if tokens_ok else sum(1 for w in order if not w.uncommitted_tokens)
    complete = 0
    for work in order:
        if work.kv_bytes:
            t += link.round_trip_seconds + work.kv_bytes / link.bytes_per_second
        token_done = tokens_ok or not work.uncommitted_tokens
        if token_done and (not work.kv_bytes or t <= deadline):
            complete += 1
    return safe, complete


def test_small_kv_first_after_all_tokens() -> None:
    pending = [
        PendingWork("big", uncommitted_tokens=2, kv_bytes=40 * MB),
        PendingWork("small", uncommitted_tokens=1, kv_bytes=5 * MB),
        PendingWork("medium", uncommitted_tokens=3, kv_bytes=10 * MB),
        PendingWork("done", uncommitted_tokens=0, kv_bytes=0),
    ]
    plan = plan_flush(pending, LinkEstimate(bytes_per_second=10 * MB), seconds_left=2.0)
    kinds = [step.kind for step in plan.steps]
    assert kinds == [FlushKind.TOKENS] * 3 + [FlushKind.KV] * 3
    assert [step.request_id for step in plan.steps if step.kind is FlushKind.KV] == [
        "small",
        "medium",
        "big",
    ]
    assert plan.expected_complete == {"done", "small", "medium"}
    assert plan.expected_tokens_safe == {"done", "small", "medium", "big"}


def test_round_trips_count_per_kv_write() -> None:
    pending = [PendingWork(f"r{i}", 1, 1 * MB) for i in range(10)]
    link = LinkEstimate(bytes_per_second=100 * MB, round_trip_seconds=0.05)
    plan = plan_flush(pending, link, seconds_left=0.36)
    # one token batch (0.05 s) + each KV write 0.06 s: five fit in 0.36 s, six would not
    assert len(plan.expected_complete) == 5
    assert len(plan.expected_tokens_safe) == 10


def test_when_even_tokens_do_not_fit_the_fewest_tokens_go_first() -> None:
    pending = [
        PendingWork("chatty", uncommitted_tokens=1000, kv_bytes=0),
        PendingWork("quiet", uncommitted_tokens=1, kv_bytes=0),
    ]
    link = LinkEstimate(bytes_per_second=1000)
    plan = plan_flush(pending, link, seconds_left=0.5)
    assert plan.expected_tokens_safe == {"quiet"}
    assert plan.expected_complete == {"quiet"}
    assert [step.request_id for step in plan.steps] == ["quiet", "chatty"]


def test_nothing_left_or_nothing_pending() -> None:
    assert plan_flush([], LinkEstimate(1.0), 10.0).steps == ()
    plan = plan_flush([PendingWork("r", 1, 10)], LinkEstimate(1.0), seconds_left=0.0)
    assert plan.expected_complete == frozenset()
    assert len(plan.steps) == 2  # still attempted, best effort


def test_invalid_input_is_refused() -> None:
    with pytest.raises(ValueError):
        PendingWork("r", -1, 0)
    with pytest.raises(ValueError):
        LinkEstimate(0.0)
    with pytest.raises(ValueError):
        plan_flush([PendingWork("r", 1, 1), PendingWork("r", 2, 2)], LinkEstimate(1.0), 1.0)


pending_lists = st.lists(
    st.builds(
        PendingWork,
        request_id=st.uuids().map(str),
        uncommitted_tokens=st.integers(0, 8),
        kv_bytes=st.integers(0, 20).map(lambda blocks: blocks * 64_000),
    ),
    max_size=10,
    unique_by=lambda work: work.request_id,
)
links = st.builds(
    LinkEstimate,
    bytes_per_second=st.integers(10_000, 10_000_000).map(float),
    round_trip_seconds=st.sampled_from([0.0, 0.001, 0.01]),
)


@settings(max_examples=300, deadline=None)
@given(
    pending=pending_lists,
    link=links,
    seconds_left=st.floats(0.0, 5.0, allow_nan=False),
    seed=st.integers(0, 2**32 - 1),
)
def test_no_random_order_saves_more(
    pending: list[PendingWork], link: LinkEstimate, seconds_left: float, seed: int
) -> None:
    plan = plan_flush(pending, link, seconds_left)
    shuffled = list(pending)
    random.Random(seed).shuffle(shuffled)
    safe, complete = simulate(shuffled, link, seconds_left)
    assert len(plan.expected_tokens_safe) >= safe
    assert len(plan.expected_complete) >= complete
    # the plan's own forecast agrees with replaying its KV order in the reference model
    kv_order = [step.request_id for step in plan.steps if step.kind is FlushKind.KV]
    by_id = {work.request_id: work for work in pending}
    ordered = [by_id[rid] for rid in kv_order] + [w for w in pending if not w.kv_bytes]
    if len(plan.expected_tokens_safe) == len(pending):
        assert simulate(ordered, link, seconds_left)[1] == len(plan.expected_complete)
    # every step the plan expects to finish is planned before every step it does not
    on_time = [
        step.done_after_seconds <= seconds_left + DEADLINE_TOLERANCE_SECONDS for step in plan.steps
    ]
    assert on_time == sorted(on_time, reverse=True)


@settings(max_examples=60, deadline=None)
@given(
    pending=pending_lists.filter(lambda p: len(p) <= 6),
    link=links,
    seconds_left=st.floats(0.0, 3.0, allow_nan=False),
)
def test_plan_matches_the_best_of_all_orders(
    pending: list[PendingWork], link: LinkEstimate, seconds_left: float
) -> None:
    plan = plan_flush(pending, link, seconds_left)
    best = max(
        (simulate(list(order), link, seconds_left) for order in itertools.permutations(pending)),
        default=(0, 0),
    )
    assert (len(plan.expected_tokens_safe), len(plan.expected_complete)) >= best
