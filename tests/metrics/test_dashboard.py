"""The Grafana dashboard asks only for series the processes really export, and never shows
the energy estimate as a measurement.

The exported names come from the three processes' own registries, rendered in the text
format and parsed back, so a renamed metric breaks this test rather than a dashboard.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from common.requests import FinishReason, SlaClass
from context_daemon.daemon import DaemonState
from context_daemon.metrics import DaemonMetrics
from context_daemon.notices import Notice, NoticeAction
from coordinator.metrics import CoordinatorMetrics
from tests.metrics.scrape import parse
from worker.energy import CpuTimeEstimate
from worker.metrics import LiveNumbers, WorkerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "grafana" / "spotinfer-dashboard.json"
METRIC_NAME = re.compile(r"\bspotinfer_[a-z0-9_]+")
SELECTOR = re.compile(r"(spotinfer_[a-z0-9_]+)\{([^}]*)\}")
LABEL = re.compile(r'([a-z_]+)\s*=~?\s*"([^"]*)"')


def _exported() -> dict[str, set[str]]:
    """Every sample name the processes serve, with the label names it carries."""
    worker = WorkerMetrics(energy_meter=CpuTimeEstimate(pid=os.getpid()))
    worker.read_live_from(lambda: LiveNumbers(1, 0, 16, 0.5, 10.0, 100))
    notice = Notice("aws", NoticeAction.TERMINATE, 0.0, 0.0)
    daemon = DaemonMetrics(30.0, lambda: True)
    daemon.read_state_from(DaemonState(last_notice=notice))
    # Labelled series appear once something happened; make each happen once, as the
    # processes do.
    daemon.notice(notice)
    coordinator = CoordinatorMetrics()
    coordinator.request_done(SlaClass.INTERACTIVE, FinishReason.LENGTH, 0.1, 0.01)
    coordinator.rejected.labels("queue_full").inc()
    coordinator.failovers.labels("notice").inc()
    coordinator.queue_capacity.labels(SlaClass.INTERACTIVE.name).set(1)
    names: dict[str, set[str]] = {}
    for text in (
        coordinator.exposition(),
        worker.exposition(),
        daemon.exposition(),
    ):
        for name, labels, _ in parse(text.decode()).samples:
            names.setdefault(name, set()).update(labels)
    # An NVML meter exports the same names with source="nvml"; only the label value differs.
    return names


def _panels() -> list[dict[str, object]]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return [p for p in panels if p.get("targets")]


def _expressions() -> list[tuple[str, str]]:
    return [(str(p["title"]), t["expr"]) for p in _panels() for t in p["targets"]]  # type: ignore[attr-defined]


def test_the_dashboard_is_valid_json_with_panels() -> None:
    assert len(_expressions()) >= 20


@pytest.mark.parametrize("title, expr", _expressions())
def test_every_expression_names_exported_series(title: str, expr: str) -> None:
    exported = _exported()
    names = METRIC_NAME.findall(expr)
    assert names, f"{title}: no spotinfer metric in {expr!r}"
    for name in names:
        assert name in exported, f"{title}: {name} is not exported by any process"
    for name, selector in SELECTOR.findall(expr):
        for label, _ in LABEL.findall(selector):
            assert label in exported[name], f"{title}: {name} has no label {label}"
    assert expr.count("(") == expr.count(")"), f"{title}: unbalanced parentheses"
    for quantile in re.findall(r"histogram_quantile\([^,]+,(.*?)\[", expr):
        assert "_bucket" in quantile, f"{title}: a quantile over something else than buckets"


def test_the_energy_estimate_is_never_titled_as_a_measurement() -> None:
    seen_estimate = False
    for panel in _panels():
        exprs = " ".join(t["expr"] for t in panel["targets"])  # type: ignore[attr-defined]
        if "energy" not in exprs:
            continue
        title = str(panel["title"]).lower()
        assert 'source="' in exprs, f"{panel['title']}: energy without its source label"
        if 'source="cpu-time-estimate"' in exprs:
            seen_estimate = True
            assert "estimate" in title and "measurement" not in title, panel["title"]
            assert 'source="nvml"' not in exprs, "estimate and measurement in one panel"
        else:
            assert "estimate" not in title, panel["title"]
    assert seen_estimate


def test_the_dashboard_covers_what_operators_watch() -> None:
    exprs = " ".join(expr for _, expr in _expressions())
    for name in (
        "spotinfer_coordinator_queue_depth",
        "spotinfer_worker_batch_size_bucket",
        "spotinfer_worker_generated_tokens_total",
        "spotinfer_coordinator_time_to_first_token_seconds_bucket",
        "spotinfer_coordinator_time_per_output_token_seconds_bucket",
        "spotinfer_worker_kv_headroom_ratio",
        "spotinfer_worker_kv_persisted_bytes_total",
        "spotinfer_worker_token_commit_seconds_bucket",
        "spotinfer_daemon_notices_total",
        "spotinfer_worker_resumed_requests_total",
        "spotinfer_worker_recomputed_tokens_total",
        "spotinfer_worker_energy_per_token_joules",
    ):
        assert name in exprs, f"the dashboard does not show {name}"
