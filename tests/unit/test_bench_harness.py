"""The benchmarks' shared harness: round order, the one percentile, the files it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.harness import alternating, benchmark_parser, percentile, plot_figure, write_json


def test_rounds_alternate_so_that_every_side_goes_first_in_turn() -> None:
    assert list(alternating(("worker", "coordinator"), 3)) == [
        (0, "worker"),
        (0, "coordinator"),
        (1, "coordinator"),
        (1, "worker"),
        (2, "worker"),
        (2, "coordinator"),
    ]
    firsts = [side for _, side in alternating(("a", "b", "c"), 3)][::3]
    assert firsts == ["a", "b", "c"]


def test_percentile_is_nearest_rank() -> None:
    hundred = [float(v) for v in range(1, 101)]
    assert percentile(hundred, 0.99) == 99.0  # 99 of the 100 values are at or below it
    assert percentile(hundred, 0.5) == 50.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.0  # the lower middle of an even count
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) == 0.0


def test_common_arguments() -> None:
    parser = benchmark_parser("doc", rounds=3, rounds_flag="--repeats", plot=True)
    args = parser.parse_args(["--json", "out.json"])
    assert (args.model, args.repeats, args.json, args.plot) == (
        "smollm2-135m",
        3,
        Path("out.json"),
        None,
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float32"])  # not asked for


def test_json_and_plot_land_in_new_folders(tmp_path: Path) -> None:
    write_json(tmp_path / "a" / "result.json", {"ratio": 0.99})
    assert json.loads((tmp_path / "a" / "result.json").read_text()) == {"ratio": 0.99}
    with plot_figure(tmp_path / "b" / "two.png", columns=2) as (_, axes):
        for axis in axes:
            axis.plot([1, 2], [3, 4])
    assert (tmp_path / "b" / "two.png").read_bytes().startswith(b"\x89PNG")
    with pytest.raises(RuntimeError), plot_figure(tmp_path / "c.png") as _:
        raise RuntimeError("a failed plot writes nothing")
    assert not (tmp_path / "c.png").exists()
