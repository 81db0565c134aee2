"""What the KV block MAC costs: block write MB/s with HMAC-SHA256 + CRC-32 against CRC-32
alone, in the same run.

Each side seals blocks in place (``seal_block``: header, MAC, CRC) and writes them with
``RedisStore.put_blocks`` to a loopback redis-server, one block per round trip, as the
worker's writer does; "crc" seals with a keyring whose MAC is a constant (the work of the
CRC-only format), "crc+mac" with a real key. Sides alternate, the order rotated per round;
FLUSHALL before every run. Also reported: the seal alone (CPU only) per side.

    python -m benchmarks.mac_cost --rounds 6 --json docs/bench/mac_cost.json
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from typing import Any

import redis
from rich.console import Console

from benchmarks.harness import alternating, benchmark_parser, print_table, write_json
from spotinfer.local.redis_process import RedisProcess
from store import BlockWrite, KVFormat, RedisStore, RequestRecord, StoreConfig
from store.block_codec import block_buffer_bytes, chain_hash, header_bytes, seal_block
from store.constants import MAC_BYTES
from store.mac_keyring import Buffer, MacKeyring, parse_keyring

# One SmolLM2-135M block: 30 layers x 3 KV heads x 64 x 128 tokens x bf16 (as kv_persistence).
BLOCK_TOKENS = 128
BLOCK_PAYLOAD_BYTES = 30 * 2 * 3 * 64 * BLOCK_TOKENS * 2
FORMAT = KVFormat("bench:mac", "bfloat16", "bench", layer_count=30, block_tokens=BLOCK_TOKENS)
SIDES = ("crc", "crc+mac")
SEAL_SAMPLES = 20


class _ConstantMac(MacKeyring):
    """The CRC-only baseline: the same header, a MAC field that costs nothing to fill."""

    def sign(self, parts: Iterable[Buffer]) -> tuple[int, bytes]:
        return self.current_id, bytes(MAC_BYTES)


KEYRINGS = {
    "crc": _ConstantMac({1: bytes(32)}, 1),
    "crc+mac": parse_keyring("1:" + "5a" * 32),
}


def _buffers(blocks: int) -> list[memoryview]:
    payload = bytes(range(256)) * (BLOCK_PAYLOAD_BYTES // 256)
    views = []
    for _ in range(blocks):
        view = memoryview(bytearray(block_buffer_bytes(FORMAT, BLOCK_PAYLOAD_BYTES)))
        view[header_bytes(FORMAT) :] = payload
        views.append(view)
    return views


def _write_run(
    store: RedisStore, buffers: list[memoryview], keyring: MacKeyring, run: int
) -> float:
    """Seal and write every block (one put per block); seconds taken."""
    request_id = f"mac-bench-{run}"
    store.create_request(RequestRecord(request_id, FORMAT.model_fingerprint, (1,), {}, 128))
    start = time.perf_counter()
    for index, buffer in enumerate(buffers):
        prefix = chain_hash(run.to_bytes(8, "little"), "bench", [index])
        sealed = seal_block(buffer, FORMAT, prefix, BLOCK_TOKENS, keyring)
        if not store.put_blocks([BlockWrite(request_id, index, sealed)]) == [True]:
            raise RuntimeError(f"block {index} was not linked")
    return time.perf_counter() - start


def _seal_mb_per_s(buffer: memoryview, keyring: MacKeyring) -> float:
    samples = []
    for _ in range(SEAL_SAMPLES):
        start = time.perf_counter()
        seal_block(buffer, FORMAT, bytes(16), BLOCK_TOKENS, keyring)
        samples.append(time.perf_counter() - start)
    return len(buffer) / statistics.median(samples) / 1e6


def measure(blocks: int, rounds: int, console: Console) -> dict[str, Any]:
    buffers = _buffers(blocks)
    mb = blocks * len(buffers[0]) / 1e6
    per_round: dict[str, list[float]] = {side: [] for side in SIDES}
    with RedisProcess() as server:
        admin = redis.Redis.from_url(server.url)
        store = RedisStore.from_url(server.url, config=StoreConfig(block_ttl_seconds=600))
        try:
            for run, (round_index, side) in enumerate(alternating(SIDES, rounds)):
                admin.flushall()
                seconds = _write_run(store, buffers, KEYRINGS[side], run)
                per_round[side].append(mb / seconds)
                console.print(f"round {round_index} {side:8s} {mb / seconds:8.0f} MB/s")
        finally:
            store.close()
            admin.close()
    write = {side: statistics.median(values) for side, values in per_round.items()}
    seal = {side: _seal_mb_per_s(buffers[0], KEYRINGS[side]) for side in SIDES}
    return {
        "block_bytes": len(buffers[0]),
        "blocks_per_run": blocks,
        "rounds": rounds,
        "write_mb_per_s": write,
        "write_mb_per_s_rounds": per_round,
        "seal_mb_per_s": seal,
        "write_ratio_mac_over_crc": write["crc+mac"] / write["crc"],
    }


def main() -> None:
    parser = benchmark_parser(__doc__, model=False, rounds=6)
    parser.add_argument("--blocks", type=int, default=48, help="blocks written per run")
    args = parser.parse_args()
    console = Console()
    result = measure(args.blocks, args.rounds, console)
    print_table(
        console,
        "KV block MAC cost",
        ["side", "write MB/s (median)", "seal only MB/s"],
        [
            [side, f"{result['write_mb_per_s'][side]:.0f}", f"{result['seal_mb_per_s'][side]:.0f}"]
            for side in SIDES
        ],
    )
    console.print(f"write with MAC / CRC alone: {result['write_ratio_mac_over_crc']:.3f}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
