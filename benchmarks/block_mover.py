"""The source side of benchmarks/peer_migration.py: a process in a source's network namespace
that moves the same KV blocks to a target, by peer push or through Redis, on command.

    python -m benchmarks.block_mover '<Spec as JSON>'    (started by peer_migration.py)

Commands come as JSON lines on stdin, results go out as JSON lines on stdout after
RESULT_PREFIX: ``{"op": "move", "path": "peer"|"redis", "streams": S, "request_id": ...}``
moves the blocks once; ``{"op": "window", "path": ..., "seconds": W, ...}`` moves them again
and again for W seconds. Every result carries the CPU seconds the source process, the target
daemon and the redis-server spent on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.kv_persistence import BLOCK_TOKENS, Geometry, kv_format_for

SMOLLM2_135M = Geometry(layers=30, kv_heads=3, head_dim=64)
FINGERPRINT = "smollm2-135m-instruct, benchmark blocks"
REDIS_BATCH_BLOCKS = 4
WINDOW_STREAMS = 4
RESULT_PREFIX = "RESULT "


@dataclass(frozen=True)
class Spec:
    """What a measuring process is told: where the target and Redis are, and the load."""

    name: str
    daemon: str
    redis_url: str
    target_namespace: str
    keyring_file: str
    blocks: int
    watched_pids: dict[str, int]

    @classmethod
    def from_json(cls, text: str) -> Spec:
        return cls(**json.loads(text))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Mover:
    """The source (and, for Redis, the target's reader): blocks built once, connections kept."""

    def __init__(self, spec: Spec) -> None:
        from context_daemon.peer_push import PeerPusher
        from context_daemon.staging_client import StagingClient
        from store import RedisStore, StoreConfig, keys
        from store.block_codec import KVBlock, chain_hash, encoded_block
        from store.mac_keyring import load_keyring

        self.spec = spec
        self.kv_format = kv_format_for(SMOLLM2_135M, FINGERPRINT)
        ring = load_keyring(spec.keyring_file)
        self.hashes = [
            chain_hash(bytes(16), FINGERPRINT, [zlib.crc32(spec.name.encode()) & 0xFFFF, i])
            for i in range(spec.blocks)
        ]
        self.encoded = [
            encoded_block(
                KVBlock(self.kv_format, h, BLOCK_TOKENS, os.urandom(SMOLLM2_135M.payload_bytes)),
                ring,
            )
            for h in self.hashes
        ]
        self.block_bytes = sum(len(e.data) for e in self.encoded)
        self.keys = [keys.block_key(h) for h in self.hashes]
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)  # gRPC's asyncio channels belong to it

        async def connect() -> tuple[dict[int, PeerPusher], StagingClient]:
            pushers = {s: PeerPusher(spec.daemon, streams=s) for s in (1, WINDOW_STREAMS)}
            return pushers, StagingClient(spec.daemon)

        self.pushers, self.staging = self.loop.run_until_complete(connect())
        config = StoreConfig(url=spec.redis_url, insecure=True, mac_key_file=spec.keyring_file)
        self.writers = [RedisStore.from_url(spec.redis_url, config=config) for _ in range(4)]
        self.readers = []
        for _ in range(4):  # connections opened in the target's namespace: its reads
            with _in_namespace(spec.target_namespace):
                reader = RedisStore.from_url(spec.redis_url, config=config)
                reader.ping()
            self.readers.append(reader)
        for store in self.writers:
            store.ping()
        self._created: set[str] = set()

    def _peer_blocks(self, request_id: str) -> list[Any]:
        from context_daemon.peer_push import PeerBlock

        return [
            PeerBlock(request_id, k, e.data) for k, e in zip(self.keys, self.encoded, strict=True)
        ]

    def push(self, request_id: str, streams: int, timeout: float) -> tuple[float, int]:
        """(seconds, bytes staged); the batch is dropped at the target afterwards."""
        pusher = self.pushers[streams]
        outcome = self.loop.run_until_complete(pusher.push(self._peer_blocks(request_id), timeout))
        self.loop.run_until_complete(self.staging.drop(request_id))
        return outcome.seconds, outcome.staged_bytes

    def write(self, request_id: str, streams: int, deadline: float = 0.0) -> tuple[float, int]:
        """(seconds, bytes written) over ``streams`` connections, REDIS_BATCH_BLOCKS blocks a
        round trip; with a ``deadline`` (monotonic), only batches done before it count."""
        from store import BlockWrite, RequestRecord, RequestStatus

        store = self.writers[0]
        if request_id not in self._created:
            self._created.add(request_id)
            store.create_request(
                RequestRecord(
                    request_id=request_id,
                    model_fingerprint=FINGERPRINT,
                    prompt_token_ids=(1, 2, 3),
                    sampling_params={"max_tokens": 1},
                    kv_block_tokens=BLOCK_TOKENS,
                    status=RequestStatus.RUNNING,
                    owner_worker_id="bench",
                )
            )
        writes = [BlockWrite(request_id, i, e) for i, e in enumerate(self.encoded)]

        def batch(lane: int, part: Sequence[Any]) -> int:
            self.writers[lane].put_blocks(part)
            return sum(len(w.block.data) for w in part)

        return _lanes(streams, writes, batch, deadline)

    def read(self, request_id: str, streams: int) -> tuple[float, int]:
        """(seconds, bytes read and verified) over ``streams`` of the target's connections."""
        from store import BlockRead, BlockRejected

        reads = [BlockRead(request_id, i, h, BLOCK_TOKENS, True) for i, h in enumerate(self.hashes)]

        def batch(lane: int, part: Sequence[Any]) -> int:
            loaded = self.readers[lane].get_blocks(part, self.kv_format)
            bad = [b for b in loaded if isinstance(b, BlockRejected)]
            if bad:
                raise RuntimeError(f"the target read back rejected blocks: {bad[0]}")
            return len(part)

        seconds, _ = _lanes(streams, reads, batch)
        return seconds, self.block_bytes

    def cpu(self) -> dict[str, float]:
        used = {"source": time.process_time()}
        used.update({name: cpu_seconds(pid) for name, pid in self.spec.watched_pids.items()})
        return used

    def run(self, command: dict[str, Any]) -> dict[str, Any]:
        before = self.cpu()
        if command["op"] == "move":
            result = self.move(command["path"], command["streams"], command["request_id"])
        else:
            result = self.window(command["path"], command["seconds"], command["request_id"])
        after = self.cpu()
        result["cpu_seconds"] = {k: after[k] - before[k] for k in after}
        return result

    def move(self, path: str, streams: int, request_id: str) -> dict[str, Any]:
        request_id = f"{self.spec.name}-{request_id}"  # one Redis serves both sources
        if path == "peer":
            seconds, moved = self.push(request_id, streams, 600.0)
            if moved != self.block_bytes:
                raise RuntimeError(f"the target staged {moved} of {self.block_bytes} bytes")
            return {"seconds": seconds, "bytes": moved}
        write_seconds, written = self.write(request_id, streams)
        read_seconds, _ = self.read(request_id, streams)
        return {
            "seconds": write_seconds + read_seconds,
            "write_seconds": write_seconds,
            "read_seconds": read_seconds,
            "bytes": written,
        }

    def window(self, path: str, seconds: float, request_id: str) -> dict[str, Any]:
        request_id = f"{self.spec.name}-{request_id}"
        start = time.monotonic()
        deadline = start + seconds
        moved = batches = 0
        while time.monotonic() < deadline:
            if path == "peer":
                _, staged = self.push(
                    f"{request_id}-{batches}", WINDOW_STREAMS, deadline - time.monotonic()
                )
            else:
                _, staged = self.write(request_id, WINDOW_STREAMS, deadline)
            moved += staged
            batches += 1
        return {"bytes": moved, "batches": batches, "seconds": seconds}


def _lanes(
    streams: int,
    items: Sequence[Any],
    batch: Callable[[int, Sequence[Any]], int],
    deadline: float = 0.0,
) -> tuple[float, int]:
    """Runs ``batch(lane, part)`` over ``streams`` threads, each taking every streams-th run
    of REDIS_BATCH_BLOCKS items; (wall seconds, bytes of the batches done in time)."""
    parts = [items[i : i + REDIS_BATCH_BLOCKS] for i in range(0, len(items), REDIS_BATCH_BLOCKS)]
    done = [0] * streams
    errors: list[BaseException] = []
    barrier = threading.Barrier(streams + 1)

    def lane(index: int) -> None:
        barrier.wait()
        try:
            for part in parts[index::streams]:
                moved = batch(index, part)
                if deadline and time.monotonic() > deadline:
                    return
                done[index] += moved
        except BaseException as error:  # noqa: BLE001 - reported by the caller
            errors.append(error)

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    if errors:
        raise errors[0]
    return seconds, sum(done)


def _in_namespace(namespace: str) -> Any:
    if not namespace:
        return contextlib.nullcontext()
    from spotinfer.rehearsal.netns import entered

    return entered(namespace)


def main(spec_json: str) -> int:
    """The measuring process: commands (JSON lines) on stdin, results on stdout."""
    from context_daemon.malloc_tuning import keep_large_buffers

    keep_large_buffers()  # as the source's daemon does (the Redis path's clients get it too)
    mover = Mover(Spec.from_json(spec_json))
    mover.move("peer", 1, "warm-peer-1")
    mover.move("peer", WINDOW_STREAMS, "warm-peer-4")
    mover.move("redis", WINDOW_STREAMS, "warm-redis")
    print(RESULT_PREFIX + json.dumps({"ready": True, "block_bytes": mover.block_bytes}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        print(RESULT_PREFIX + json.dumps(mover.run(command)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
