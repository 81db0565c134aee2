"""The load generator plans what it promises and counts what a client really saw."""

from __future__ import annotations

import statistics

import pytest

from protos.spotinfer.v1 import common_pb2
from spotinfer.loadgen import (
    Arrival,
    LoadSpec,
    RequestTrace,
    Sampling,
    _record,
    goodput,
    percentile,
    plan_requests,
    summarize,
)


def test_plan_is_deterministic_and_within_ranges() -> None:
    spec = LoadSpec(num_requests=50, rate_per_second=5, prompt_tokens=(8, 16), output_tokens=(4, 9))
    first, second = plan_requests(spec), plan_requests(spec)
    assert first == second
    assert len({r.request_id for r in first}) == 50
    assert all(8 <= len(r.prompt_token_ids) <= 16 and 4 <= r.max_tokens <= 9 for r in first)
    assert plan_requests(LoadSpec(num_requests=50, rate_per_second=5, seed=1)) != first


def test_a_seeded_load_samples_with_a_seed_of_its_own_per_request() -> None:
    greedy = plan_requests(LoadSpec(num_requests=4, rate_per_second=0))
    assert {(r.temperature, r.sampling_seed) for r in greedy} == {(0.0, None)}
    seeded = plan_requests(LoadSpec(num_requests=4, rate_per_second=0, sampling=Sampling.SEEDED))
    assert {r.temperature for r in seeded} == {1.0}
    assert len({r.sampling_seed for r in seeded}) == 4 and None not in {
        r.sampling_seed for r in seeded
    }
    assert [r.prompt_token_ids for r in seeded] == [r.prompt_token_ids for r in greedy]


def test_poisson_gaps_average_one_over_the_rate() -> None:
    planned = plan_requests(LoadSpec(num_requests=4000, rate_per_second=10.0))
    gaps = [
        b.send_offset_seconds - a.send_offset_seconds
        for a, b in zip(planned, planned[1:], strict=False)
    ]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(0.1, rel=0.15)  # exponential: sd = mean


def test_bursts_arrive_together() -> None:
    planned = plan_requests(
        LoadSpec(num_requests=20, rate_per_second=8.0, arrival=Arrival.BURSTY, burst_size=5)
    )
    offsets = [r.send_offset_seconds for r in planned]
    assert len(set(offsets)) == 4
    assert all(offsets.count(o) == 5 for o in set(offsets))


def test_batch_fraction_sets_sla_classes() -> None:
    planned = plan_requests(LoadSpec(num_requests=400, rate_per_second=0, batch_fraction=0.25))
    batch = sum(r.sla_class == common_pb2.SLA_CLASS_BATCH for r in planned)
    assert 60 <= batch <= 140


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError):
        LoadSpec(num_requests=0, rate_per_second=1)
    with pytest.raises(ValueError):
        LoadSpec(num_requests=1, rate_per_second=1, prompt_tokens=(10, 5))
    with pytest.raises(ValueError):
        LoadSpec(num_requests=1, rate_per_second=-1)


def _response(index: int, tokens: list[int], finish: int = 0) -> common_pb2.GenerateResponse:
    return common_pb2.GenerateResponse(index=index, token_ids=tokens, finish_reason=finish)  # type: ignore[arg-type]


def test_record_counts_duplicates_and_gaps() -> None:
    trace = RequestTrace("r", 1, 4, 10, sent_at=0.0)
    _record(trace, _response(0, [1, 2]), 1.0)
    _record(trace, _response(1, [2, 3]), 2.0)  # index 1 repeated
    _record(
        trace,
        _response(5, [9]),
        3.0,
    )  # 2 tokens missing
    assert trace.token_ids == [1, 2, 3, 9]
    assert trace.duplicates == 1
    assert trace.gaps == 2
    assert trace.token_times == [1.0, 1.0, 2.0, 3.0]


def test_summary_and_goodput() -> None:
    fast = RequestTrace("a", 1, 4, 3, sent_at=0.0, token_ids=[1, 2, 3], token_times=[0.1, 0.2, 0.3])
    slow = RequestTrace("b", 1, 4, 3, sent_at=0.0, token_ids=[1, 2, 3], token_times=[2.0, 2.5, 3.0])
    failed = RequestTrace("c", 1, 4, 3, sent_at=0.0, error_code="RESOURCE_EXHAUSTED")
    summary = summarize([fast, slow, failed])
    assert summary.completed == 2
    assert summary.errors == {"RESOURCE_EXHAUSTED": 1}
    assert summary.output_tokens == 6
    assert summary.tokens_per_second == pytest.approx(2.0)
    assert summary.ttft_ms_p99 == pytest.approx(2000)
    assert goodput([fast, slow, failed], ttft_ms=500, tpot_ms=1000) == pytest.approx(1 / 3)


def test_percentile_nearest_rank() -> None:
    values = list(range(1, 101))
    assert percentile(values, 0.5) == 50
    assert percentile(values, 0.99) == 99
    assert percentile([], 0.5) == 0.0
