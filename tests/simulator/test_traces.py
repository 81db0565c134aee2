from __future__ import annotations

from pathlib import Path

from spotinfer.simulator.traces import WaveSpec, scale, spotserve, tile, waves

SPOTSERVE_LINES = """\
[0, "add", {"nodes": ["n0", "n1", "n2", "n3"]}]
[60000, "remove", {"nodes": ["n1"]}]
[120000, "add", {"nodes": ["n4"]}]
[180000, "DONE", {"nodes": []}]
"""


def test_a_spotserve_trace_becomes_node_counts_scaled_and_tiled(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(SPOTSERVE_LINES)
    trace = spotserve(path)
    assert trace.initial == {"a": 4}
    assert [(e.time_seconds, e.capacity) for e in trace.events] == [(60.0, 3), (120.0, 4)]
    assert trace.span_seconds == 180.0
    scaled = scale(trace, 40)  # one node there is ten here
    assert scaled.initial == {"a": 40}
    assert [e.capacity for e in scaled.events] == [30, 40]
    assert scaled.notices() == 10
    tiled = tile(scaled, 400.0)
    times = [e.time_seconds for e in tiled.events]
    assert times == [60.0, 120.0, 180.0, 240.0, 300.0, 360.0]  # 180 s: the start again
    assert tiled.notices() == 20  # the drops at 60 and 240 s


def test_waves_take_a_share_of_one_zone_within_the_cluster_window() -> None:
    spec = WaveSpec(zones=2, capacity_per_zone=50, waves_per_zone_per_day=6, span_seconds=86400)
    trace = waves(spec)
    assert trace.notices() > 0
    for zone in trace.zones:
        level, drop_times = spec.capacity_per_zone, []
        for event in (e for e in trace.events if e.zone == zone):
            if event.capacity < level:
                drop_times.append(event.time_seconds)
            else:  # the capacity came back: the wave is over
                if drop_times:
                    assert max(drop_times) - min(drop_times) <= spec.cluster_seconds
                    taken = spec.capacity_per_zone - level
                    assert 0.3 * 50 - 1 <= taken <= 0.8 * 50 + 1
                drop_times = []
                assert event.capacity == spec.capacity_per_zone
            level = event.capacity
