"""KV save and load MB/s through the chunked path vs the per-block path, same server, same run.

    python -m benchmarks.kv_chunks [--tokens 4096] [--block-tokens 16] [--chunk-tokens 256]
                                   [--layout LBHNC] [--rounds 5] [--json OUT]

One `redis-server` on a free loopback port, started here, and a paged bf16 cache of the
model's geometry (SmolLM2-135M: 30 layers x 3 KV heads x 64 head_dim) in vLLM's ``--layout``
(kv_copy.layer_views: the strides vLLM gives that layout), with blocks of ``--block-tokens``
tokens (16: a GPU's; 128: vLLM-CPU's). Each round, in alternating order, a context of
``--tokens`` tokens is saved and loaded back by

- ``per-block``: the store's value is one engine block (what the connector stored before
  chunks: one Redis key per block);
- ``chunked``: the store's value is a chunk of ``--chunk-tokens`` tokens (several engine
  blocks gathered into one host buffer);

each through the connector's own steps: save = `KVCopier.gather` (all layers of the value's
blocks into one buffer after the header room) + `seal_block` + `RedisStore.put_blocks` in
batches of KV_WRITE_BATCH_BLOCKS values (as the writer thread sends them); load =
`RedisStore.get_blocks` (one round trip, every check of `decode_block`) + `KVCopier.scatter`
into other cache slots. The loaded cache is compared with the saved one byte for byte.
MB/s = KV payload bytes / wall seconds (1 MB = 10^6 bytes); medians over rounds; the ratio
chunked / per-block is what the comparison reports.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import redis
import torch
from rich.console import Console

from benchmarks.harness import (
    benchmark_parser,
    print_table,
    resolve_model_arg,
    rotated,
    write_json,
)
from benchmarks.kv_persistence import Geometry
from spotinfer.local.redis_process import RedisProcess
from store import (
    BlockRejected,
    BlockWrite,
    KVFormat,
    RedisStore,
    RequestRecord,
    RequestStatus,
    StoreConfig,
    block_reads,
)
from store.block_codec import header_bytes, seal_block
from store.constants import KV_WRITE_BATCH_BLOCKS
from store.redis_link import connect
from worker.kv_copy import VLLM_LAYOUTS, BlockShape, KVCopier, layer_views
from worker.kv_layout import block_buffer, host_tensor

PATHS = ("per-block", "chunked")
BF16_BYTES = 2
REQUEST_ID = "bench-kv-chunks"
MB = 1_000_000


class ChunkBench:
    """A source cache holding the context in slots [0, n), a target cache it loads into."""

    def __init__(
        self, store: RedisStore, admin: redis.Redis, geometry: Geometry, args: Any, fingerprint: str
    ) -> None:
        self._store = store
        self._admin = admin
        self._tokens = int(args.tokens)
        self._block_tokens = int(args.block_tokens)
        layout = next(layout for layout in VLLM_LAYOUTS if layout.name == args.layout)
        shape = BlockShape(
            geometry.kv_heads,
            self._block_tokens,
            2 * geometry.head_dim * BF16_BYTES,
            BF16_BYTES,
            geometry.head_dim,
        )
        self._copier = KVCopier(layout, shape, geometry.layers, "tokens", f"bench:{layout.name}")
        self._blocks = -(-self._tokens // self._block_tokens)
        size = geometry.layers * self._blocks * shape.block_bytes
        generator = torch.Generator().manual_seed(0)
        self._source_raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        self._target_raw = torch.zeros(size, dtype=torch.uint8)
        self._source = layer_views(self._source_raw, layout, geometry.layers, self._blocks, shape)
        self._target = layer_views(self._target_raw, layout, geometry.layers, self._blocks, shape)
        self._fingerprint = fingerprint
        self._formats = {
            "per-block": self._format(self._block_tokens, layout.name, geometry.layers),
            "chunked": self._format(int(args.chunk_tokens), layout.name, geometry.layers),
        }
        self._run = 0

    def _format(self, value_tokens: int, layout: str, layers: int) -> KVFormat:
        return KVFormat(self._fingerprint, "bfloat16", f"bench:{layout}", layers, value_tokens)

    def run(self, path: str) -> dict[str, float]:
        kv_format = self._formats[path]
        self._run += 1
        token_ids = [(self._run * 7919 + index) % 50000 for index in range(self._tokens)]
        self._admin.flushall()  # every run starts from the same empty server
        self._store.create_request(
            RequestRecord(
                request_id=REQUEST_ID,
                model_fingerprint=self._fingerprint,
                prompt_token_ids=tuple(token_ids),
                sampling_params={"max_tokens": 1},
                kv_block_tokens=kv_format.block_tokens,
                status=RequestStatus.RUNNING,
                owner_worker_id="bench",
            )
        )
        reads = block_reads(REQUEST_ID, kv_format, token_ids)
        self._target_raw.zero_()
        save_seconds = self._save(kv_format, reads)
        load_seconds = self._load(kv_format, reads)
        if not torch.equal(self._source_raw, self._target_raw):
            raise AssertionError(f"{path}: the loaded cache differs from the saved one")
        payload = self._copier.value_bytes(self._blocks, 0)
        return {
            "values": len(reads),
            "save_mb_per_second": payload / save_seconds / MB,
            "load_mb_per_second": payload / load_seconds / MB,
        }

    def _value_blocks(self, kv_format: KVFormat, index: int, num_tokens: int) -> list[int]:
        per_value = kv_format.block_tokens // self._block_tokens
        return list(
            range(index * per_value, index * per_value + -(-num_tokens // self._block_tokens))
        )

    def _save(self, kv_format: KVFormat, reads: list[Any]) -> float:
        header = header_bytes(kv_format)
        start = time.perf_counter()
        writes = []
        for read in reads:
            _, last = self._copier.last_block_tokens(read.num_tokens)
            data = self._copier.gather(
                self._source,
                self._value_blocks(kv_format, read.block_index, read.num_tokens),
                last,
                header,
            )
            sealed = seal_block(block_buffer(data), kv_format, read.prefix_hash, read.num_tokens)
            writes.append(BlockWrite(REQUEST_ID, read.block_index, sealed))
            if len(writes) == KV_WRITE_BATCH_BLOCKS:
                self._store.put_blocks(writes)
                writes = []
        if writes:
            self._store.put_blocks(writes)
        return time.perf_counter() - start

    def _load(self, kv_format: KVFormat, reads: list[Any]) -> float:
        start = time.perf_counter()
        blocks = self._store.get_blocks(reads, kv_format)
        for read, block in zip(reads, blocks, strict=True):
            if isinstance(block, BlockRejected):
                raise AssertionError(f"value {read.block_index} was not stored: {block}")
            _, last = self._copier.last_block_tokens(block.num_tokens)
            self._copier.scatter(
                self._target,
                self._value_blocks(kv_format, read.block_index, block.num_tokens),
                host_tensor(block.payload),
                last,
            )
        return time.perf_counter() - start


def measure(args: Any, console: Console) -> dict[str, Any]:
    from worker.model_fingerprint import model_fingerprint

    model_dir = Path(resolve_model_arg(args.model))
    geometry = Geometry.of_model(model_dir)
    fingerprint = model_fingerprint(str(model_dir), "bfloat16")
    runs: dict[str, list[dict[str, float]]] = {path: [] for path in PATHS}
    with RedisProcess() as server:
        store = RedisStore(connect(server.url, False, StoreConfig()))
        admin = redis.Redis.from_url(server.url)
        try:
            bench = ChunkBench(store, admin, geometry, args, fingerprint)
            for path in PATHS:  # warm-up: connection, scripts, allocator
                bench.run(path)
            for round_index in range(args.rounds):
                for path in rotated(PATHS, round_index):
                    runs[path].append(bench.run(path))
                console.print(f"round {round_index + 1}/{args.rounds} done")
        finally:
            store.close()
            admin.close()
    medians = {
        path: {
            key: statistics.median(run[key] for run in runs[path])
            for key in ("save_mb_per_second", "load_mb_per_second")
        }
        | {"values": runs[path][0]["values"]}
        for path in PATHS
    }
    return {
        "tokens": args.tokens,
        "block_tokens": args.block_tokens,
        "chunk_tokens": args.chunk_tokens,
        "layout": args.layout,
        "rounds": args.rounds,
        "medians": medians,
        "ratio_chunked_over_per_block": {
            key: medians["chunked"][key] / medians["per-block"][key]
            for key in ("save_mb_per_second", "load_mb_per_second")
        },
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, rounds=5)
    parser.add_argument("--tokens", type=int, default=4096, help="context saved and loaded")
    parser.add_argument("--block-tokens", type=int, default=16, help="engine block size")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk")
    parser.add_argument(
        "--layout", default="LBHNC", choices=[layout.name for layout in VLLM_LAYOUTS]
    )
    args = parser.parse_args(argv)
    if args.chunk_tokens % args.block_tokens:
        parser.error("--chunk-tokens must be a multiple of --block-tokens")
    torch.set_num_threads(1)  # as in a worker process (OMP_NUM_THREADS=1)
    console = Console()
    result = measure(args, console)
    print_table(
        console,
        f"KV save/load, {args.tokens} tokens, blocks of {args.block_tokens}, {args.layout}",
        ["path", "values", "save MB/s", "load MB/s"],
        [
            [
                path,
                str(result["medians"][path]["values"]),
                f"{result['medians'][path]['save_mb_per_second']:.0f}",
                f"{result['medians'][path]['load_mb_per_second']:.0f}",
            ]
            for path in PATHS
        ],
    )
    ratio = result["ratio_chunked_over_per_block"]
    console.print(
        f"chunked / per-block: save {ratio['save_mb_per_second']:.2f}x, "
        f"load {ratio['load_mb_per_second']:.2f}x"
    )
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
