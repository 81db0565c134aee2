"""KV persistence throughput (MB/s) through our write path vs `redis-benchmark` SET, same server.

    python -m benchmarks.kv_persistence [--blocks 128] [--pipelines 1,16] [--rounds 5]
                                             [--json OUT]

One `redis-server` on a free loopback port, started here. Each round, for each pipelining
depth P and in alternating order, the same number of KV blocks of SmolLM2-135M geometry
(30 layers x 3 KV heads x 128 tokens x 2 x 64 x bf16 = 2,949,120 payload bytes) is written by

- ``writer``: the worker's `KVBlockWriter` (what the connector hands blocks to): per block,
  `KVCopier.gather` copies every layer's slot of a paged bf16 cache of this geometry
  straight into the buffer it will be sent from; the writer thread seals it in place
  (header, CRC-32) and `RedisStore.put_blocks` sends it (a plain SET per block, one
  ATTACH_BLOCK script per request and batch), P blocks per engine step, the next step
  submitted once the last one is written;
- ``writer, streamed``: the same writer given all N blocks at once, as when blocks become
  full faster than Redis takes them: the thread forms its own batches (whatever is queued
  when it finishes the previous one); compared against redis-benchmark's best depth;
- ``put_blocks``: `RedisStore.put_blocks` called directly with P ready `KVBlock`s (codec and
  pipeline, no tensor copy or thread hand-off);
- ``redis-py SET``: the same client library, built as the store builds it, sending P
  pre-encoded values as plain SETs in one pipeline (no codec, no script): what the Python
  client alone costs;
- ``redis-benchmark``: ``redis-benchmark -t set -d <encoded block size> -P P -c 1 -n N
  -r 1000000 --csv``, SETs of a value exactly as long as one encoded block.

Fairness: one connection on every path (the writer thread owns one; ``-c 1``); the same value
size (the encoded block, header included); the same pipelining depth (P SETs per round trip;
our path also sends one small ATTACH_BLOCK script per round trip, counted as overhead, not
bytes);
the server is emptied (FLUSHALL) before every run, so each starts with the same memory state;
distinct keys (content-addressed blocks; ``-r`` for redis-benchmark). MB/s = encoded bytes /
wall seconds, 1 MB = 10^6 bytes. Medians over rounds.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import torch
from rich.console import Console
from rich.progress import Progress

from benchmarks.harness import benchmark_parser, print_table, resolve_model_arg, rotated, write_json
from spotinfer.local.redis_process import RedisProcess
from store import (
    BlockWrite,
    KVBlock,
    KVFormat,
    RedisStore,
    RequestRecord,
    RequestStatus,
    StoreConfig,
)
from store.block_codec import chain_hash, encode_block, header_bytes, seal_block
from store.block_writer import KVBlockWriter, PendingBlock
from store.redis_link import RedisClient, connect
from worker.constants import KV_WRITE_QUEUE_BLOCKS
from worker.kv_copy import VLLM_LAYOUTS, BlockShape, KVCopier
from worker.kv_layout import block_buffer

PATHS = ("writer", "put_blocks", "redis-py SET", "redis-benchmark")
BLOCK_TOKENS = 128  # vLLM-CPU's KV block size
BF16_BYTES = 2
RANDOM_KEYSPACE = 1_000_000
WRITER_TIMEOUT_SECONDS = 120.0
REQUEST_ID = "bench-kv-persistence"
MB = 1_000_000
COST_SAMPLES = 20
CACHE_SLOTS = 8  # blocks of the synthetic paged cache the writer path copies from


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def payload_bytes(self) -> int:
        # K and V for every token of the block, every head, every layer.
        return self.layers * self.kv_heads * BLOCK_TOKENS * 2 * self.head_dim * BF16_BYTES

    @classmethod
    def of_model(cls, model_dir: Path) -> Geometry:
        config = json.loads((model_dir / "config.json").read_text())
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        return cls(
            layers=int(config["num_hidden_layers"]),
            kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=head_dim,
        )


class BatchRecordingStore(RedisStore):
    """The real store, noting how many blocks each `put_blocks` call carried (the pipelining
    depth the writer thread actually reached)."""

    def __init__(self, client: RedisClient) -> None:
        super().__init__(client)
        self.batch_sizes: list[int] = []

    def put_blocks(self, writes: Sequence[BlockWrite]) -> list[bool]:
        self.batch_sizes.append(len(writes))
        return super().put_blocks(writes)


def kv_format_for(geometry: Geometry, fingerprint: str) -> KVFormat:
    """The format a vLLM-CPU worker's connector stores bf16 blocks of this geometry in (one
    value per 128-token block), so that what this process reads verifies."""
    from types import SimpleNamespace

    from worker.kv_layout import (
        TOKEN_COLUMN_ISAS,
        ParallelPlace,
        cpu_attention_isa,
        layout_string,
    )

    isa = cpu_attention_isa(
        SimpleNamespace(dtype=torch.bfloat16, block_size=BLOCK_TOKENS, head_size=geometry.head_dim)
    )
    shape = BlockShape(geometry.kv_heads, BLOCK_TOKENS, 2 * geometry.head_dim * BF16_BYTES)
    layout = layout_string(
        "CPU_ATTN",
        VLLM_LAYOUTS[0],
        shape,
        "bfloat16",
        ParallelPlace(),
        "kt-v" if isa in TOKEN_COLUMN_ISAS else "whole",
        isa,
    )
    return KVFormat(fingerprint, "bfloat16", layout, geometry.layers, BLOCK_TOKENS)


def block_hash(run_tag: int, index: int, fingerprint: str) -> bytes:
    """A distinct content address per block and run (as distinct prompts would give)."""
    return chain_hash(bytes(16), fingerprint, [run_tag, index])


class Bench:
    def __init__(self, redis_url: str, port: int, geometry: Geometry, fingerprint: str) -> None:
        self._port = port
        self._admin = redis.Redis.from_url(redis_url)
        # The store gets a client built as the worker builds its own (same timeouts, bytes).
        self._store = BatchRecordingStore(connect(redis_url, False, StoreConfig()))
        self._client = connect(redis_url, False, StoreConfig())
        self._format = kv_format_for(geometry, fingerprint)
        self._fingerprint = fingerprint
        # Random bytes: CRC-32 and the socket do not care what the KV values are. The layer
        # tensors have vLLM-CPU's paged shape [slots, kv_heads, block, 2 * head_dim] in bf16.
        generator = torch.Generator().manual_seed(0)
        self._layers = [
            torch.randint(
                0,
                256,
                (CACHE_SLOTS, geometry.kv_heads, BLOCK_TOKENS, 2 * geometry.head_dim * BF16_BYTES),
                dtype=torch.uint8,
                generator=generator,
            ).view(torch.bfloat16)
            for _ in range(geometry.layers)
        ]
        self._header_bytes = header_bytes(self._format)
        shape = BlockShape(
            geometry.kv_heads, BLOCK_TOKENS, 2 * geometry.head_dim * BF16_BYTES, BF16_BYTES
        )
        self._copier = KVCopier(VLLM_LAYOUTS[0], shape, geometry.layers, "whole", "bench")
        self._payload = bytes(block_buffer(self._copy(0))[self._header_bytes :])
        self.value_bytes = len(
            encode_block(KVBlock(self._format, bytes(16), BLOCK_TOKENS, self._payload))
        )
        self._run_tag = 0

    def _copy(self, slot: int) -> torch.Tensor:
        """What the connector does inside a step: one block, all layers, into its send buffer."""
        return self._copier.gather(self._layers, [slot % CACHE_SLOTS], 0, self._header_bytes)

    def _fresh_server(self) -> int:
        """Empty the server and create the request the blocks are linked to."""
        self._admin.flushall()
        self._store.create_request(
            RequestRecord(
                request_id=REQUEST_ID,
                model_fingerprint=self._fingerprint,
                prompt_token_ids=(1, 2, 3),
                sampling_params={"max_tokens": 1},
                kv_block_tokens=BLOCK_TOKENS,
                status=RequestStatus.RUNNING,
                owner_worker_id="bench",
            )
        )
        self._run_tag += 1
        return self._run_tag

    def run(self, path: str, blocks: int, pipeline: int) -> dict[str, Any]:
        run_tag = self._fresh_server()
        if path == "writer":
            return self._run_writer(run_tag, blocks, pipeline)
        if path == "put_blocks":
            return self._run_put_blocks(run_tag, blocks, pipeline)
        if path == "redis-py SET":
            return self._run_plain_set(run_tag, blocks, pipeline)
        return self._run_redis_benchmark(blocks, pipeline)

    def _result(self, blocks: int, seconds: float, **extra: Any) -> dict[str, Any]:
        return {
            "blocks": blocks,
            "seconds": seconds,
            "mb_per_second": blocks * self.value_bytes / seconds / MB,
            **extra,
        }

    def run_streamed(self, blocks: int) -> dict[str, Any]:
        """The writer with every block queued at once (the queue holds them all)."""
        return self._run_writer(self._fresh_server(), blocks, blocks)

    def _run_writer(self, run_tag: int, blocks: int, pipeline: int) -> dict[str, Any]:
        self._store.batch_sizes = []
        writer = KVBlockWriter(self._store, self._format, KV_WRITE_QUEUE_BLOCKS)
        try:
            start = time.perf_counter()
            for step_start in range(0, blocks, pipeline):
                step = range(step_start, min(blocks, step_start + pipeline))
                for index in step:
                    writer.submit(
                        PendingBlock(
                            REQUEST_ID,
                            index,
                            block_hash(run_tag, index, self._fingerprint),
                            self._copy(index),
                        )
                    )
                if not writer.wait_settled(step.stop, WRITER_TIMEOUT_SECONDS):
                    raise TimeoutError("the KV block writer stopped making progress")
            seconds = time.perf_counter() - start
            dropped = writer.dropped_blocks
        finally:
            writer.close(WRITER_TIMEOUT_SECONDS)
        if dropped:
            raise RuntimeError(f"the writer dropped {dropped} blocks; the run measures nothing")
        stored = self._count_blocks()
        if stored != blocks:
            raise RuntimeError(f"{stored} blocks in Redis after writing {blocks}")
        sizes = self._store.batch_sizes
        return self._result(
            blocks, seconds, mean_batch_blocks=statistics.mean(sizes), batches=len(sizes)
        )

    def _run_put_blocks(self, run_tag: int, blocks: int, pipeline: int) -> dict[str, Any]:
        writes = [
            BlockWrite(
                REQUEST_ID,
                index,
                KVBlock(
                    self._format,
                    block_hash(run_tag, index, self._fingerprint),
                    BLOCK_TOKENS,
                    self._payload,
                ),
            )
            for index in range(blocks)
        ]
        start = time.perf_counter()
        linked = 0
        for step_start in range(0, blocks, pipeline):
            linked += sum(self._store.put_blocks(writes[step_start : step_start + pipeline]))
        seconds = time.perf_counter() - start
        if linked != blocks or self._count_blocks() != blocks:
            raise RuntimeError(f"only {linked} of {blocks} blocks were linked")
        return self._result(blocks, seconds)

    def _run_plain_set(self, run_tag: int, blocks: int, pipeline: int) -> dict[str, Any]:
        value = encode_block(KVBlock(self._format, bytes(16), BLOCK_TOKENS, self._payload))
        start = time.perf_counter()
        for step_start in range(0, blocks, pipeline):
            pipe = self._client.pipeline(transaction=False)
            for index in range(step_start, min(blocks, step_start + pipeline)):
                pipe.set(f"plain:{run_tag}:{index}", value)
            pipe.execute()
        return self._result(blocks, time.perf_counter() - start)

    def _run_redis_benchmark(self, blocks: int, pipeline: int) -> dict[str, Any]:
        command = [
            "redis-benchmark",
            *("-p", str(self._port)),
            *("-t", "set"),
            *("-d", str(self.value_bytes)),
            *("-P", str(pipeline)),
            *("-c", "1"),
            *("-n", str(blocks)),
            *("-r", str(RANDOM_KEYSPACE)),
            "--csv",
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
        rows = list(csv.DictReader(io.StringIO(done.stdout)))
        rps = float(rows[0]["rps"])
        return self._result(blocks, blocks / rps, rps=rps, command=" ".join(command))

    def per_block_costs_ms(self) -> dict[str, float]:
        """Median cost of the two CPU steps of the writer path, one block at a time."""

        def median_ms(step: Any) -> float:
            samples = []
            for _ in range(COST_SAMPLES):
                start = time.perf_counter()
                step()
                samples.append((time.perf_counter() - start) * 1000)
            return statistics.median(samples)

        copy = self._copy(0)
        return {
            "copy_block": median_ms(lambda: self._copy(1)),
            "seal_block": median_ms(
                lambda: seal_block(block_buffer(copy), self._format, bytes(16), BLOCK_TOKENS)
            ),
        }

    def _count_blocks(self) -> int:
        return sum(1 for _ in self._admin.scan_iter(match="si:v1:blk:*", count=1000))

    def close(self) -> None:
        self._store.close()
        self._client.close()
        self._admin.close()


def measure(
    model_dir: Path, blocks: int, pipelines: list[int], rounds: int, console: Console
) -> dict[str, Any]:
    from worker.model_fingerprint import model_fingerprint

    geometry = Geometry.of_model(model_dir)
    fingerprint = model_fingerprint(str(model_dir), "bfloat16")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        str(p): {path: [] for path in PATHS} for p in pipelines
    }
    streamed: list[dict[str, Any]] = []
    with RedisProcess() as server:
        bench = Bench(server.url, server.port, geometry, fingerprint)
        try:
            for pipeline in pipelines:  # warm-up: connections, scripts, allocator
                for path in PATHS:
                    bench.run(path, min(blocks, 2 * pipeline), pipeline)
            with Progress(console=console) as progress:
                task = progress.add_task(
                    "writing blocks", total=rounds * (len(pipelines) * len(PATHS) + 1)
                )
                for r in range(rounds):
                    order = rotated(PATHS, r)
                    if r % 2:
                        streamed.append(bench.run_streamed(blocks))
                    for pipeline in pipelines:
                        for path in order:
                            runs[str(pipeline)][path].append(bench.run(path, blocks, pipeline))
                            progress.update(task, advance=1)
                    if r % 2 == 0:
                        streamed.append(bench.run_streamed(blocks))
                    progress.update(task, advance=1)
        finally:
            bench.close()
        value_bytes = bench.value_bytes
        costs = bench.per_block_costs_ms()
    result = summarize(runs, geometry, value_bytes, blocks, rounds)
    result["per_block_costs_ms"] = costs
    best_depth, best = max(
        (
            (pipeline, summary["mb_per_second_median"]["redis-benchmark"])
            for pipeline, summary in result["by_pipeline"].items()
        ),
        key=lambda item: item[1],
    )
    streamed_median = statistics.median(r["mb_per_second"] for r in streamed)
    result["writer_streamed"] = {
        "mb_per_second_median": streamed_median,
        "mean_batch_blocks": statistics.mean(r["mean_batch_blocks"] for r in streamed),
        "vs_best_redis_benchmark": streamed_median / best,
        "best_redis_benchmark_pipeline": int(best_depth),
        "best_redis_benchmark_mb_per_second": best,
        "runs": streamed,
    }
    return result


def summarize(
    runs: dict[str, dict[str, list[dict[str, Any]]]],
    geometry: Geometry,
    value_bytes: int,
    blocks: int,
    rounds: int,
) -> dict[str, Any]:
    by_pipeline: dict[str, Any] = {}
    for pipeline, paths in runs.items():
        medians = {
            path: statistics.median(r["mb_per_second"] for r in results)
            for path, results in paths.items()
        }
        by_pipeline[pipeline] = {
            "mb_per_second_median": medians,
            "writer_vs_redis_benchmark": medians["writer"] / medians["redis-benchmark"],
            "put_blocks_vs_redis_benchmark": medians["put_blocks"] / medians["redis-benchmark"],
            "redis_py_set_vs_redis_benchmark": medians["redis-py SET"] / medians["redis-benchmark"],
            # Paired within a round (the runs of one round are seconds apart), so a slow
            # minute on the shared machine moves both sides of a ratio alike.
            "writer_vs_redis_benchmark_per_round": [
                w["mb_per_second"] / b["mb_per_second"]
                for w, b in zip(paths["writer"], paths["redis-benchmark"], strict=True)
            ],
            "writer_mean_batch_blocks": statistics.mean(
                r["mean_batch_blocks"] for r in paths["writer"]
            ),
            "redis_benchmark_command": paths["redis-benchmark"][0]["command"],
        }
    return {
        "model_geometry": {
            "layers": geometry.layers,
            "kv_heads": geometry.kv_heads,
            "head_dim": geometry.head_dim,
            "block_tokens": BLOCK_TOKENS,
            "dtype": "bfloat16",
        },
        "payload_bytes": geometry.payload_bytes,
        "value_bytes": value_bytes,
        "blocks_per_run": blocks,
        "rounds": rounds,
        "connections": 1,
        "by_pipeline": by_pipeline,
        "runs": runs,
    }


def print_report(result: dict[str, Any], console: Console) -> None:
    print_table(
        console,
        f"KV persistence, {result['value_bytes']:,}-byte blocks "
        f"({result['blocks_per_run']} per run, 1 connection, median of {result['rounds']})",
        ("P", *PATHS, "writer / r-b", "put_blocks / r-b"),
        [
            (
                pipeline,
                *(f"{summary['mb_per_second_median'][path]:.0f} MB/s" for path in PATHS),
                f"{summary['writer_vs_redis_benchmark']:.3f}",
                f"{summary['put_blocks_vs_redis_benchmark']:.3f}",
            )
            for pipeline, summary in result["by_pipeline"].items()
        ],
    )
    streamed = result["writer_streamed"]
    console.print(
        f"writer, streamed ({result['blocks_per_run']} blocks queued at once, batches of "
        f"{streamed['mean_batch_blocks']:.1f}): {streamed['mb_per_second_median']:.0f} MB/s = "
        f"{streamed['vs_best_redis_benchmark']:.3f} x redis-benchmark at its best depth "
        f"(P={streamed['best_redis_benchmark_pipeline']}, "
        f"{streamed['best_redis_benchmark_mb_per_second']:.0f} MB/s)"
    )
    costs = result["per_block_costs_ms"]
    console.print(
        "writer batches (blocks per put_blocks): "
        + ", ".join(
            f"P={p}: {s['writer_mean_batch_blocks']:.1f}" for p, s in result["by_pipeline"].items()
        )
        + f"; per-block costs outside the socket: copy out of the cache "
        f"{costs['copy_block']:.2f} ms, seal (header + CRC) {costs['seal_block']:.2f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, rounds=5)
    parser.add_argument("--blocks", type=int, default=128, help="blocks written per run")
    parser.add_argument("--pipelines", default="1,16", help="pipelining depths, comma-separated")
    args = parser.parse_args(argv)
    if shutil.which("redis-benchmark") is None:
        parser.error("redis-benchmark is not on PATH (Debian/Ubuntu: apt-get install redis-tools)")
    torch.set_num_threads(1)  # as in a worker process (OMP_NUM_THREADS=1)
    console = Console()
    pipelines = [int(p) for p in args.pipelines.split(",")]
    if any(p > KV_WRITE_QUEUE_BLOCKS for p in pipelines):
        parser.error(f"a pipeline deeper than the writer's queue ({KV_WRITE_QUEUE_BLOCKS})")
    result = measure(
        Path(resolve_model_arg(args.model)), args.blocks, pipelines, args.rounds, console
    )
    print_report(result, console)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
