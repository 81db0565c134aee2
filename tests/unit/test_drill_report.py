"""Each invariant check fails on the traces that break it."""

from __future__ import annotations

from pathlib import Path

from protos.spotinfer.v1 import common_pb2
from spotinfer.drills.report import ClusterEvent, build_report
from spotinfer.drills.timeline import plot_timeline
from spotinfer.loadgen import RequestTrace, TraceEvent

LENGTH = common_pb2.FINISH_REASON_LENGTH


def _trace(
    rid: str, tokens: list[int], events: list[TraceEvent] | None = None, **kw: object
) -> RequestTrace:
    trace = RequestTrace(rid, 1, 4, len(tokens), sent_at=0.0, finish_reason=LENGTH)
    trace.token_ids = list(tokens)
    trace.token_times = [0.1 * (i + 1) for i in range(len(tokens))]
    trace.token_workers = ["w-a"] * (len(tokens) // 2) + ["w-b"] * (len(tokens) - len(tokens) // 2)
    trace.events = events or []
    for key, value in kw.items():
        setattr(trace, key, value)
    return trace


REFERENCE = {"r1": [1, 2, 3, 4], "r2": [5, 6, 7, 8]}


def _report(traces: list[RequestTrace], leaked: int = 0, notice: bool = True):  # type: ignore[no-untyped-def]
    return build_report(
        "notice", "spotinfer", traces, REFERENCE, leaked, 128, expect_zero_recompute=notice
    )


def test_a_clean_drill_passes() -> None:
    migrated = TraceEvent(0.25, "migrated", "w-a", "w-b", 0, 256)
    report = _report([_trace("r1", [1, 2, 3, 4], [migrated]), _trace("r2", [5, 6, 7, 8])])
    assert report.verdict == "PASS"
    assert report.migrations == 1 and report.recomputed_tokens == 0


def test_each_broken_invariant_fails_the_drill() -> None:
    cases = {
        "lost": _trace("r1", [1, 2], error_code="UNAVAILABLE"),
        "duplicates": _trace("r1", [1, 2, 3, 4], duplicates=1),
        "gaps": _trace("r1", [1, 2, 3, 4], gaps=2),
        "fidelity_mismatches": _trace("r1", [1, 2, 9, 4]),
        "recomputed_tokens": _trace(
            "r1", [1, 2, 3, 4], [TraceEvent(0.2, "migrated", recomputed_tokens=5)]
        ),
        "recompute_bound": _trace(
            "r1", [1, 2, 3, 4], [TraceEvent(0.2, "recovered", recomputed_tokens=256)]
        ),
    }
    # 128-token chunks: the unfinished one and one whose write was in flight is < 256
    in_flight = _trace("r1", [1, 2, 3, 4], [TraceEvent(0.2, "recovered", recomputed_tokens=255)])
    bound = {c.name: c for c in _report([in_flight], notice=False).checks}["recompute_bound"]
    assert bound.passed and bound.value == 0
    for name, broken in cases.items():
        report = _report([broken, _trace("r2", [5, 6, 7, 8])])
        failed = {c.name for c in report.checks if not c.passed}
        assert report.verdict == "FAIL", name
        assert name in failed, (name, failed)
    assert _report([_trace("r1", [1, 2, 3, 4])], leaked=3).verdict == "FAIL"
    forged = build_report(
        "notice",
        "spotinfer",
        [_trace("r1", [1, 2, 3, 4])],
        REFERENCE,
        0,
        128,
        True,
        mac_rejected_blocks=1,
    )
    assert forged.verdict == "FAIL"
    assert {c.name for c in forged.checks if not c.passed} == {"mac_rejected_blocks"}


def test_abrupt_loss_allows_bounded_recompute() -> None:
    recovered = TraceEvent(0.2, "recovered", recomputed_tokens=100)
    report = _report([_trace("r1", [1, 2, 3, 4], [recovered])], notice=False)
    assert report.verdict == "PASS"
    assert report.recomputed_tokens == 100


def test_json_has_the_contract_fields(tmp_path: Path) -> None:
    report = _report([_trace("r1", [1, 2, 3, 4])])
    report.write_json(tmp_path / "out.json")
    import json

    data = json.loads((tmp_path / "out.json").read_text())
    for key in (
        "lost",
        "duplicates",
        "gaps",
        "fidelity_mismatches",
        "recomputed_tokens",
        "requests",
        "p50_ms",
        "p99_ms",
        "verdict",
    ):
        assert key in data


def test_timeline_png(tmp_path: Path) -> None:
    traces = [
        _trace("r1", [1, 2, 3, 4], [TraceEvent(0.25, "migrated")]),
        _trace("r2", [5, 6, 7, 8]),
    ]
    out = plot_timeline(traces, [ClusterEvent(0.2, "notice", "w-a")], tmp_path / "t.png", "drill")
    assert out.read_bytes()[:4] == b"\x89PNG"
