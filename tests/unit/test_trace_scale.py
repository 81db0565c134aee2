"""A trace's waves keep their share of the fleet when mapped onto a small local cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotinfer.drills.scenarios import read_trace
from spotinfer.drills.trace_scale import TraceScale

TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "spotserve" / "As.jsonl"


def nodes(*numbers: int) -> list[str]:
    return [f"node-{n}" for n in numbers]


def test_a_wave_takes_its_share_of_the_local_fleet_not_what_its_names_map_to() -> None:
    scale = TraceScale.first_wave(nodes(*range(10)), local_nodes=5)
    # 20% of the trace: 1 of 5 local nodes, whichever names the trace used.
    assert scale.remove(nodes(0, 1), serving=5, at_seconds=10) == 1
    # 50% of what is left (4 of 8): half the local serving nodes.
    assert scale.remove(nodes(2, 3, 4, 5), serving=4, at_seconds=20) == 2
    assert (
        "trace removes 4 of 8 (50%) → 2 of 4 local serving node(s) noticed (50%)"
        in (scale.notes[-1])
    )


def test_a_small_wave_still_preempts_one_node_and_never_all() -> None:
    scale = TraceScale.first_wave(nodes(*range(20)), local_nodes=4)
    assert scale.remove(nodes(0), serving=4, at_seconds=1) == 1  # 5% rounds to 0: one
    assert scale.remove(nodes(*range(1, 19)), serving=3, at_seconds=2) == 2  # 95%: all but one
    assert scale.local_nodes == 1


def test_the_whole_trace_fleet_taken_takes_the_whole_local_fleet() -> None:
    scale = TraceScale.first_wave(nodes(0, 1, 2), local_nodes=4)
    assert scale.remove(nodes(0, 1, 2), serving=4, at_seconds=1) == 4


def test_one_serving_node_lets_a_partial_wave_pass_and_says_so() -> None:
    scale = TraceScale.first_wave(nodes(0, 1, 2, 3), local_nodes=1)
    assert scale.remove(nodes(0), serving=1, at_seconds=1) == 0
    assert "→ 0 of 1 local serving node(s) noticed" in scale.notes[-1]


def test_joins_grow_the_local_fleet_to_the_scaled_size() -> None:
    scale = TraceScale.first_wave(nodes(*range(7)), local_nodes=4)
    assert scale.add(nodes(7), at_seconds=1) == 1  # 8 × 4/7 = 4.6 → 5
    assert scale.add(nodes(8, 9), at_seconds=2) == 1  # 10 × 4/7 = 5.7 → 6
    assert scale.add(nodes(9), at_seconds=3) == 0, "a node the trace already has adds nothing"


def test_a_removal_of_nodes_the_trace_never_had_takes_nothing() -> None:
    scale = TraceScale.first_wave(nodes(0, 1), local_nodes=2)
    assert scale.remove(nodes(5), serving=2, at_seconds=1) == 0


def test_an_empty_first_wave_is_refused() -> None:
    with pytest.raises(ValueError, match="need a node each"):
        TraceScale.first_wave([], local_nodes=3)


@pytest.mark.skipif(not TRACE.exists(), reason=f"the SpotServe trace is not at {TRACE}")
def test_the_a_s_trace_on_four_local_nodes() -> None:
    """SpotServe's A_S (7 nodes, then 10; removes 1 of 10, then 2 of 10) on 2 workers and 2
    standbys: 3 joins and 2 notices of one node each, not a wave that empties the cluster."""
    entries = read_trace(TRACE)
    _, _, first = entries[0]
    scale = TraceScale.first_wave(first["nodes"], local_nodes=4)
    joins = notices = 0
    for when_ms, action, payload in entries[1:]:
        if action == "add":
            joins += scale.add(payload["nodes"], when_ms / 1000)
        elif action == "remove":
            notices += scale.remove(payload["nodes"], scale.local_nodes, when_ms / 1000)
    assert (joins, notices) == (3, 2)
