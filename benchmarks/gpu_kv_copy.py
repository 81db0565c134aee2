"""KV copy path on a GPU: bit-exact round trips and device <-> host MB/s in every KV layout.

    python -m benchmarks.gpu_kv_copy [--layers 32] [--heads 8] [--head-dim 128]
                                     [--blocks 2048] [--chunk-blocks 16] [--values 32]
                                     [--rounds 5] [--json OUT]

Needs only PyTorch with CUDA (no vLLM, no Redis): run it from a checkout on the GPU machine.
For each of vLLM 0.32's KVCacheLayouts (kv_copy.VLLM_LAYOUTS), a bf16 paged cache of the
geometry given (default: Llama-3-8B per rank, 32 layers x 8 KV heads x 128 head_dim, blocks of
16 tokens) is laid out on the device with vLLM's strides (kv_copy.layer_views), and
``--values`` chunks of ``--chunk-blocks`` blocks each (256 tokens: the connector's default
chunk) are

- saved: `KVCopier.gather` from scattered cache slots into one host buffer per chunk,
  pageable and pinned (``pin_memory``), and
- loaded: `KVCopier.scatter` of those buffers into other slots,

checked byte for byte against the source (partial tails too: the last chunk ends 5 tokens
into its last block), and timed with CUDA synchronisation around each side. A third kind,
``stream``, goes through the connector's own path (worker/kv_transfer.py: a side stream, the
pinned pool, an event per copy, pageable destinations as the writer's): its ``issue`` time is
how long the calling thread is held by the 32 saves' calls, beside the time until all are on
the host. Also the plain bus rate (one contiguous ``copy_`` of the same bytes device -> host,
pageable and pinned) and the overlap: two steps (trains of bf16 matmuls on the compute
stream) with the saves (into pinned buffers) issued between them, against each alone.
MB/s = KV bytes / wall seconds (1 MB = 10^6 bytes), medians over rounds, sides alternating.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout, not installed

from worker.kv_copy import VLLM_LAYOUTS, BlockShape, CacheLayout, KVCopier, layer_views  # noqa: E402
from worker.kv_transfer import HIGH_PRIORITY, CopyStream, Transfer  # noqa: E402

MB = 1_000_000
TAIL_TOKENS = 5


def _timed(run: Callable[[], Any]) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _host_kinds(device: str) -> tuple[bool, ...]:
    """Pageable, and pinned where there is a CUDA device to pin for."""
    return (False, True) if device == "cuda" else (False,)


def check_layout(layout: CacheLayout, args: argparse.Namespace) -> dict[str, Any]:
    """Round trips of one layout, bit-exact, and their MB/s (pageable and pinned)."""
    shape = BlockShape(args.heads, args.block_tokens, 2 * args.head_dim * 2, 2, args.head_dim)
    copier = KVCopier(layout, shape, args.layers, "tokens", f"gpu:{layout.name}")
    size = args.layers * args.blocks * shape.block_bytes
    generator = torch.Generator(device=args.device).manual_seed(0)
    source_raw = torch.randint(
        0, 256, (size,), dtype=torch.uint8, device=args.device, generator=generator
    )
    target_raw = torch.zeros_like(source_raw)
    source = layer_views(source_raw, layout, args.layers, args.blocks, shape)
    target = layer_views(target_raw, layout, args.layers, args.blocks, shape)
    order = torch.randperm(args.blocks, generator=torch.Generator().manual_seed(1)).tolist()
    runs = [
        (
            order[i * args.chunk_blocks : (i + 1) * args.chunk_blocks],
            order[-(i + 1) * args.chunk_blocks :][: args.chunk_blocks],
        )
        for i in range(args.values)
    ]
    lasts = [0] * (args.values - 1) + [TAIL_TOKENS]
    kv_bytes = sum(
        copier.value_bytes(len(src), last) for (src, _), last in zip(runs, lasts, strict=True)
    )
    result: dict[str, Any] = {"layout": layout.name, "kv_bytes": kv_bytes}
    for pinned in _host_kinds(args.device):
        saves, loads = [], []
        for _ in range(args.rounds):
            values: list[torch.Tensor] = []

            def save(values: list[torch.Tensor] = values, pinned: bool = pinned) -> None:
                for (src, _), last in zip(runs, lasts, strict=True):
                    values.append(copier.gather(source, src, last, pin_memory=pinned))

            def load(values: list[torch.Tensor] = values) -> None:
                for (_, dst), value, last in zip(runs, values, lasts, strict=True):
                    copier.scatter(target, dst, value, last)

            saves.append(_timed(save))
            target_raw.zero_()
            loads.append(_timed(load))
            _check(layout, source, target, runs, lasts, args.block_tokens)
        key = "pinned" if pinned else "pageable"
        result[f"save_mb_per_second_{key}"] = kv_bytes / statistics.median(saves) / MB
        result[f"load_mb_per_second_{key}"] = kv_bytes / statistics.median(loads) / MB
    if args.device == "cuda":
        result |= _stream_side(copier, source, target, target_raw, runs, lasts, args, kv_bytes)
    result["round_trips_bit_exact"] = True
    return result


def _stream_side(
    copier: KVCopier,
    source: list[torch.Tensor],
    target: list[torch.Tensor],
    target_raw: torch.Tensor,
    runs: list[tuple[list[int], list[int]]],
    lasts: list[int],
    args: argparse.Namespace,
    kv_bytes: int,
) -> dict[str, float]:
    """The same saves and loads through CopyStream: MB/s, and the calling thread's share."""
    copies = CopyStream("cuda", pool_bytes=2 * kv_bytes)
    outs = [
        torch.empty(copier.value_bytes(len(src), last), dtype=torch.uint8)
        for (src, _), last in zip(runs, lasts, strict=True)
    ]
    saves, loads, issues = [], [], []
    for _ in range(args.rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        transfers = [
            copies.save(copier, source, src, last, out)
            for (src, _), last, out in zip(runs, lasts, outs, strict=True)
        ]
        issues.append(time.perf_counter() - start)
        for transfer in transfers:
            transfer.finish()
        saves.append(time.perf_counter() - start)
        target_raw.zero_()
        torch.cuda.synchronize()
        start = time.perf_counter()
        landed: list[Transfer] = [
            copies.load(copier, target, dst, out, last)
            for (_, dst), last, out in zip(runs, lasts, outs, strict=True)
        ]
        for transfer in landed:
            transfer.finish()
        torch.cuda.synchronize()
        loads.append(time.perf_counter() - start)
        _check(copier.layout, source, target, runs, lasts, args.block_tokens)
    return {
        "save_mb_per_second_stream": kv_bytes / statistics.median(saves) / MB,
        "load_mb_per_second_stream": kv_bytes / statistics.median(loads) / MB,
        "save_issue_ms_stream": statistics.median(issues) * 1000,
        "save_done_ms_stream": statistics.median(saves) * 1000,
        "pool_pageable_fallbacks": copies.pool.pageable_fallbacks,
    }


def overlap(args: argparse.Namespace, priority: int) -> dict[str, float]:
    """A worker's two steps with the saves between them, as the connector issues them: step
    (bf16 matmuls on the compute stream), saves of one layout (side stream, waiting for the
    step), the next step. Against the two steps alone and the saves alone: the share of the
    saves' time hidden behind the next step (1.0: all of it). ms, medians over rounds."""
    layout = VLLM_LAYOUTS[0]
    shape = BlockShape(args.heads, args.block_tokens, 2 * args.head_dim * 2, 2, args.head_dim)
    copier = KVCopier(layout, shape, args.layers, "tokens", f"gpu:{layout.name}")
    raw = torch.randint(
        0, 256, (args.layers * args.blocks * shape.block_bytes,), dtype=torch.uint8, device="cuda"
    )
    views = layer_views(raw, layout, args.layers, args.blocks, shape)
    runs = [
        list(range(i * args.chunk_blocks, (i + 1) * args.chunk_blocks)) for i in range(args.values)
    ]
    outs = [  # pinned, as the daemon's ring would be once registered: the copies alone
        torch.empty(copier.value_bytes(len(run)), dtype=torch.uint8, pin_memory=True)
        for run in runs
    ]
    copies = CopyStream("cuda", pool_bytes=0, priority=priority)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def step() -> None:
        for _ in range(40):
            a @ a  # noqa: B018

    def save() -> list[Transfer]:
        return [
            copies.save(copier, views, run, 0, out) for run, out in zip(runs, outs, strict=True)
        ]

    def finish(transfers: list[Transfer]) -> None:
        for transfer in transfers:
            transfer.finish()

    def steps() -> None:
        step()
        step()

    def steps_with_saves() -> None:
        step()
        transfers = save()
        step()
        finish(transfers)

    figures: dict[str, list[float]] = {"two_steps_ms": [], "saves_ms": [], "with_saves_ms": []}
    finish(save())  # warm the side stream's memory
    for _ in range(args.rounds):
        figures["two_steps_ms"].append(_timed(steps) * 1000)
        figures["saves_ms"].append(_timed(lambda: finish(save())) * 1000)
        figures["with_saves_ms"].append(_timed(steps_with_saves) * 1000)
    medians = {key: statistics.median(values) for key, values in figures.items()}
    added = medians["with_saves_ms"] - medians["two_steps_ms"]
    medians["hidden_share"] = 1 - added / medians["saves_ms"]
    return medians


def _check(
    layout: CacheLayout,
    source: list[torch.Tensor],
    target: list[torch.Tensor],
    runs: list[tuple[list[int], list[int]]],
    lasts: list[int],
    block_tokens: int,
) -> None:
    """Every loaded block equals its saved one, byte for byte (a tail: its filled tokens)."""
    for (src, dst), last in zip(runs, lasts, strict=True):
        for position, (s, d) in enumerate(zip(src, dst, strict=True)):
            tokens = last if last and position == len(src) - 1 else block_tokens
            for sv, tv in zip(source, target, strict=True):
                if not torch.equal(sv[s, :, :tokens], tv[d, :, :tokens]):
                    raise AssertionError(f"{layout.name}: block {s} -> {d} differs")


def bus_rate(total_bytes: int, rounds: int) -> dict[str, float]:
    """One contiguous device -> host and host -> device copy, pageable vs pinned."""
    device = torch.empty(total_bytes, dtype=torch.uint8, device="cuda")
    figures = {}
    for pinned in (False, True):
        host = torch.empty(total_bytes, dtype=torch.uint8, pin_memory=pinned)
        key = "pinned" if pinned else "pageable"
        down = statistics.median(_timed(partial(host.copy_, device)) for _ in range(rounds))
        up = statistics.median(_timed(partial(device.copy_, host)) for _ in range(rounds))
        figures[f"d2h_mb_per_second_{key}"] = total_bytes / down / MB
        figures[f"h2d_mb_per_second_{key}"] = total_bytes / up / MB
    return figures


def print_report(result: dict[str, Any]) -> None:
    print(f"{result['device']}, torch {result['torch']}; MB/s, every round trip bit-exact")
    kinds = [
        key.removeprefix("save_mb_per_second_")
        for key in result["layouts"][0]
        if key.startswith("save_mb_per_second_")
    ]
    print(f"{'layout':8}" + "".join(f" {'save ' + k:>14} {'load ' + k:>14}" for k in kinds))
    for row in result["layouts"]:
        print(
            f"{row['layout']:8}"
            + "".join(
                f" {row['save_mb_per_second_' + k]:14.0f} {row['load_mb_per_second_' + k]:14.0f}"
                for k in kinds
            )
        )
    bus = result.get("bus")
    if bus:
        print(
            f"bus, one contiguous copy: D2H pageable {bus['d2h_mb_per_second_pageable']:.0f}, "
            f"pinned {bus['d2h_mb_per_second_pinned']:.0f}; H2D pageable "
            f"{bus['h2d_mb_per_second_pageable']:.0f}, "
            f"pinned {bus['h2d_mb_per_second_pinned']:.0f}"
        )
    for row in result["layouts"]:
        if "save_issue_ms_stream" in row:
            print(
                f"{row['layout']:8} stream: the saves' calls held the thread "
                f"{row['save_issue_ms_stream']:.1f} ms of {row['save_done_ms_stream']:.1f} ms "
                f"(pageable fallbacks {row['pool_pageable_fallbacks']})"
            )
    for name, lap in result.get("overlap", {}).items():
        print(
            f"overlap, side stream of {name.replace('_', ' ')}: two steps "
            f"{lap['two_steps_ms']:.1f} ms, saves alone {lap['saves_ms']:.1f} ms, two steps "
            f"with the saves between them {lap['with_saves_ms']:.1f} ms: "
            f"{lap['hidden_share']:.0%} of the saves hidden"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--chunk-blocks", type=int, default=16)
    parser.add_argument("--values", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the checks"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark measures the GPU copy path (or --device cpu)")
    if 2 * args.values * args.chunk_blocks > args.blocks:
        parser.error("--blocks must hold 2 x --values x --chunk-blocks blocks")
    cuda = args.device == "cuda"
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (dry run)",
        "torch": torch.__version__,
        "arguments": vars(args) | {"json": str(args.json)},
        "layouts": [check_layout(layout, args) for layout in VLLM_LAYOUTS],
    }
    if cuda:
        result["bus"] = bus_rate(result["layouts"][0]["kv_bytes"], args.rounds)
        result["overlap"] = {
            "high_priority": overlap(args, HIGH_PRIORITY),
            "normal_priority": overlap(args, 0),
        }
    print_report(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
