"""The drills' pure parts, without a cluster: schedules, the client's retry rule, goodput and
the comparison benchmark's arithmetic."""

from __future__ import annotations

import math
from pathlib import Path

import grpc
import pytest

from benchmarks.drill_compare import PolicyRun, auto_slo_seconds, markdown_table, ratios
from protos.spotinfer.v1 import common_pb2
from spotinfer.drills.report import goodput_rps
from spotinfer.drills.scenarios import read_trace, rolling_schedule, trace_span_seconds
from spotinfer.loadgen import NextCall, RequestTrace, next_call

Code = grpc.StatusCode


def test_rolling_schedule_counts_from_the_first_notice() -> None:
    assert rolling_schedule(15.0, 30.0, 300.0) == [15.0 + 30.0 * k for k in range(10)]
    assert rolling_schedule(2.0, 10.0, 15.0) == [2.0, 12.0]
    assert rolling_schedule(0.0, 10.0, 1.0) == [0.0], "a duration shorter than one interval"
    with pytest.raises(ValueError):
        rolling_schedule(0.0, 0.0, 10.0)


def test_trace_is_read_in_spotserve_format(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '[0, "add", {"nodes": ["a", "b"]}]\n\n[5000, "remove", {"nodes": ["a"]}]\n'
        '[9000, "DONE", {"nodes": []}]\n'
    )
    assert [(t, action) for t, action, _ in read_trace(trace)] == [
        (0, "add"),
        (5000, "remove"),
        (9000, "DONE"),
    ]
    assert trace_span_seconds(trace) == 9.0


@pytest.mark.parametrize(
    ("code", "was_attach", "tokens", "expected"),
    [
        (Code.UNAVAILABLE, False, 0, NextCall.ATTACH),  # refused, or the coordinator died
        (Code.UNAVAILABLE, True, 12, NextCall.ATTACH),  # broke again mid-stream
        (Code.NOT_FOUND, True, 0, NextCall.GENERATE),  # nobody knows it: send it again
        (Code.NOT_FOUND, True, 3, NextCall.GIVE_UP),  # tokens were seen: really lost
        (Code.NOT_FOUND, False, 0, NextCall.GIVE_UP),
        (Code.INVALID_ARGUMENT, False, 0, NextCall.GIVE_UP),
    ],
)
def test_the_client_retry_rule(
    code: grpc.StatusCode, was_attach: bool, tokens: int, expected: NextCall
) -> None:
    assert next_call(code, was_attach, tokens) == expected


def _trace(rid: str, sent: float, last: float, ok: bool = True) -> RequestTrace:
    trace = RequestTrace(rid, 1, 4, 2, sent_at=sent)
    trace.token_times = [sent + 0.1, last]
    trace.token_ids = [1, 2]
    trace.finish_reason = common_pb2.FINISH_REASON_LENGTH
    trace.error_code = "" if ok else "NOT_FOUND"
    return trace


def test_goodput_counts_completed_requests_within_the_slo_per_second() -> None:
    traces = [_trace("a", 0.0, 1.0), _trace("b", 1.0, 5.0), _trace("c", 2.0, 10.0, ok=False)]
    assert goodput_rps(traces) == pytest.approx(2 / 10.0)  # c failed
    assert goodput_rps(traces, sla_e2e_ms=2000) == pytest.approx(1 / 10.0)  # b took 4 s
    assert goodput_rps([]) == 0.0


def _run(policy: str, e2e: list[float | None], disturbed: list[bool], **report: float) -> PolicyRun:
    return PolicyRun("rolling", policy, report=dict(report), e2e_seconds=e2e, disturbed=disturbed)


def test_auto_slo_is_twice_the_median_of_undisturbed_requests_pooled() -> None:
    ours = _run("spotinfer", [1.0, 2.0, 9.0], [False, False, True])
    theirs = _run("reroute", [3.0, None, 30.0], [False, False, True])
    assert auto_slo_seconds([ours, theirs]) == pytest.approx(2 * 2.0)  # median of 1, 2, 3
    touched = _run("reroute", [4.0, 6.0], [True, True])
    assert auto_slo_seconds([touched]) == pytest.approx(2 * 5.0)
    assert math.isinf(auto_slo_seconds([]))


def test_ratios_and_the_markdown_table() -> None:
    ours = _run("spotinfer", [1.0], [False], p50_ms=1000.0, p99_ms=2000.0, verdict="PASS")
    theirs = _run("reroute", [3.0], [False], p50_ms=1500.0, p99_ms=6000.0, verdict="PASS")
    ours.goodput_rps, theirs.goodput_rps = 0.5, 0.25
    found = ratios([ours, theirs])
    assert found["p99_reroute_over_spotinfer"] == pytest.approx(3.0)
    assert found["p50_reroute_over_spotinfer"] == pytest.approx(1.5)
    assert found["goodput_spotinfer_over_reroute"] == pytest.approx(2.0)
    assert ratios([ours]) == {}, "no ratio without both policies"
    table = markdown_table(
        {
            "scenarios": [
                {
                    "scenario": "rolling",
                    "slo_seconds": 4.0,
                    "runs": [ours.summary(), theirs.summary()],
                    "ratios": found,
                }
            ]
        }
    )
    assert "| rolling | reroute |" in table and "| 3.00× |" in table
