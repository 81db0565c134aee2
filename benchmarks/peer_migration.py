"""Peer migration vs Redis: moving a noticed node's KV blocks to its target, and two nodes at once.

    python -m benchmarks.peer_migration [--blocks 32] [--rounds 3] [--window-seconds 10]
                                        [--json OUT]

The same encoded KV blocks of SmolLM2-135M geometry (30 layers x 3 KV heads x 128 tokens x
2 x 64 x bf16: 2,949,120 payload bytes, sealed with the header, CRC and MAC as the store
keeps them; see kv_persistence.py) go from a source to a target

- ``peer xS``: the source pushes them with `PeerPusher` (context_daemon/peer_push.py) over S
  streams (S channels, S TCP flows) to the target's daemon, a real `python -m context_daemon`
  process, which checks each block's CRC and MAC and stages it (peer_staging.py);
- ``redis xS``: the source writes them with `RedisStore.put_blocks` (4 blocks a round trip)
  to a redis-server over S connections (S threads), then the target reads them back with
  `RedisStore.get_blocks` (4 a round trip, each block checked against its format, CRC and MAC)
  over S connections of its own. Its MB/s counts both halves; the write alone is reported
  too (a source whose VM goes away must finish that much before its deadline).

The network: every node is a Linux network namespace on one bridge (spotinfer/rehearsal/
netns.py: a veth pair from each namespace into the bridge, 10.213.0.0/24, no shaping), the
source's pushes and writes leave the source's namespace, the target's reads leave the
target's, and the target daemon and the redis-server each listen in a namespace of their
own. Without root or ``ip netns`` (or with ``--loopback``) everything runs on 127.0.0.1. Rounds
alternate the order of the four sides (benchmarks.harness.rotated). MB/s = block bytes /
wall seconds, 1 MB = 10^6 bytes; medians over rounds; the CPU seconds each process spent are
kept beside every run.

Then "two nodes noticed at once": sources A and B each move blocks as fast as they can for
``--window-seconds`` (default 10; a GCP notice gives 30 s, of which a migration has to keep
some for the coordinator's hand-off and the last stage), 4 streams each, starting together:

- peer: each source pushes to its own target's daemon (batches of ``--blocks``, each batch
  dropped at the target once staged, so memory stays bounded);
- Redis: both sources write to ONE redis-server (4 connections each), the blocks of each
  batch over the previous ones (a content address written again).

Reported: the bytes each source got to its target (peer: staged; Redis: written, which the
targets still have to read back after the window) before the window closed. The scales lean
towards Redis there: a peer push counts once the target has checked every block's MAC, a
Redis write before anyone has (the read-back does).

The sources are processes of their own (benchmarks/block_mover.py), started in their
namespaces and told what to move. The daemons and the sources keep big buffers on the heap
(context_daemon/malloc_tuning.py), as a daemon does; the redis-server is as Debian ships it.

Everything shares one machine: with 2 cores the source, the target and Redis compete for
CPU, and the veth "wire" is memory copies. Figures are bounds of this machine, not of a
cloud network.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from benchmarks.block_mover import (
    RESULT_PREFIX,
    SMOLLM2_135M,
    WINDOW_STREAMS,
    Spec,
)
from benchmarks.harness import benchmark_parser, print_table, rotated, write_json
from benchmarks.kv_persistence import BLOCK_TOKENS
from spotinfer.local.daemon_process import DaemonProcess
from spotinfer.local.managed_process import ManagedProcess, free_port, process_environment
from spotinfer.local.redis_process import REDIS_SERVER_BINARY

SIDES = ("peer x1", "peer x4", "redis x1", "redis x4")
STAGING_MAX_BYTES = 3 * 1024**3
MB = 1_000_000
READY_TIMEOUT_SECONDS = 120.0
REDIS_READY_LINE = "Ready to accept connections"
REDIS_PORT = 6379
NETNS_PREFIX = "sppm"


# --- the orchestrating process ----------------------------------------------------------------


class NamespacedRedis(ManagedProcess):
    """A plaintext redis-server listening on ``address`` (in a namespace when ``wrap``)."""

    def __init__(self, address: str, port: int, wrap: Sequence[str], folder: Path) -> None:
        self.address, self.port = address, port
        self._wrap = list(wrap)
        self._ready = threading.Event()
        super().__init__("redis-server", folder / "redis.log", cwd=folder)

    @property
    def url(self) -> str:
        return f"redis://{self.address}:{self.port}/0"

    def on_line(self, line: str) -> None:
        if REDIS_READY_LINE in line:
            self._ready.set()

    def start(self) -> NamespacedRedis:
        command = [REDIS_SERVER_BINARY, "--bind", self.address, "--port", str(self.port)]
        command += ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
        self.spawn([*self._wrap, *command])
        self.wait_until(self._ready.is_set, READY_TIMEOUT_SECONDS, 0.05)
        return self

    def stop(self) -> None:
        self.terminate(10.0)


class MeasuringProcess:
    """A `benchmarks.block_mover` process (in a source's namespace): send commands, read
    results."""

    def __init__(self, spec: Spec, wrap: Sequence[str], log: Path) -> None:
        command = [*wrap, sys.executable, "-m", "benchmarks.block_mover", json.dumps(spec.__dict__)]
        self._log = log.open("w")
        self.process = subprocess.Popen(  # noqa: S603 - our own module
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=process_environment(),
        )
        self.ready = self.result()

    def send(self, command: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def result(self) -> dict[str, Any]:
        out = self.process.stdout
        assert out is not None
        while True:
            ready, _, _ = select.select([out], [], [], READY_TIMEOUT_SECONDS)
            line = out.readline() if ready else ""
            if not line:
                self._log.flush()
                tail = Path(self._log.name).read_text()[-3000:]
                raise RuntimeError(f"the measuring process stopped:\n{tail}")
            if line.startswith(RESULT_PREFIX):
                return dict(json.loads(line[len(RESULT_PREFIX) :]))

    def close(self) -> None:
        if self.process.poll() is None:
            self.send({"op": "quit"})
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._log.close()


@dataclass
class Node:
    """Where a process of the benchmark runs: its namespace (none on loopback) and address."""

    namespace: str
    address: str
    wrap: tuple[str, ...]


class Testbed:
    """The nodes, the redis-server, the two target daemons and the two measuring processes;
    all stopped (and the namespaces removed) on close, also after a failure."""

    def __init__(self, folder: Path, blocks: int, loopback: bool) -> None:
        self.folder = folder
        self.blocks = blocks
        self.network: Any = None
        self.link = "loopback (127.0.0.1)"
        self.started: list[Any] = []
        self.movers: dict[str, MeasuringProcess] = {}
        self.loopback = loopback

    def node(self, name: str) -> Node:
        if self.network is None:
            return Node("", "127.0.0.1", ())
        host = self.network.add_host(name, metadata_address=False)
        return Node(host.namespace, host.address, tuple(host.command([])))

    def open(self, console: Console) -> Testbed:
        from store.mac_keyring import new_keyring_text

        if not self.loopback:
            from spotinfer.rehearsal.netns import Network, sweep_leftovers, unavailable_reason

            reason = unavailable_reason()
            if reason:
                console.print(f"[yellow]no network namespaces ({reason}): loopback only")
            else:
                sweep_leftovers(NETNS_PREFIX)  # a killed earlier run's
                self.network = Network(prefix=NETNS_PREFIX).open()
                self.link = (
                    "network namespaces on one Linux bridge, a veth pair each "
                    "(10.213.0.0/24, no shaping)"
                )
        keyring_file = self.folder / "kv-mac.keys"
        keyring_file.write_text(new_keyring_text())
        redis_node = self.node("redis")
        redis = NamespacedRedis(
            redis_node.address, REDIS_PORT if self.network else free_port(), redis_node.wrap,
            self.folder,
        )  # fmt: skip
        self.started.append(redis.start())
        for name in ("a", "b"):
            target, source = self.node(f"dst-{name}"), self.node(f"src-{name}")
            daemon = DaemonProcess(
                *("--notice-source", "file", "--notice-file", str(self.folder / "no-notice")),
                *("--kv-mac-key-file", str(keyring_file)),
                *("--staging-max-bytes", str(STAGING_MAX_BYTES)),
                log_dir=self.folder,
                host=target.address,
                wrap=target.wrap,
            )
            self.started.append(daemon.start())
            spec = Spec(
                name=f"source-{name}",
                daemon=daemon.address,
                redis_url=redis.url,
                target_namespace=target.namespace,
                keyring_file=str(keyring_file),
                blocks=self.blocks,
                watched_pids={
                    "target_daemon": _real_pid(daemon),
                    "redis": _real_pid(redis),
                },
            )
            self.movers[name] = MeasuringProcess(spec, source.wrap, self.folder / f"src-{name}.log")
        return self

    def close(self) -> None:
        for mover in self.movers.values():
            mover.close()
        for process in reversed(self.started):
            process.stop()
        if self.network is not None:
            self.network.close()


def _real_pid(process: ManagedProcess) -> int:
    """The pid of the server itself (the launch wrapper and ``ip netns exec`` exec it)."""
    assert process.pid is not None
    return process.pid


def measure(
    testbed: Testbed, rounds: int, window_seconds: float, console: Console
) -> dict[str, Any]:
    source = testbed.movers["a"]
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    windows: dict[str, list[dict[str, Any]]] = {"peer": [], "redis": []}
    window_order = ("peer", "redis")
    total = rounds * len(SIDES) + rounds * len(window_order)
    with Progress(console=console) as progress:
        task = progress.add_task("moving blocks", total=total)
        for r in range(rounds):
            for side in rotated(SIDES, r):
                path, streams = side.split(" x")
                source.send(
                    {
                        "op": "move",
                        "path": path,
                        "streams": int(streams),
                        "request_id": f"m{r}-{path}{streams}",
                    }
                )
                runs[side].append(source.result())
                progress.advance(task)
        progress.update(task, description=f"two nodes, {window_seconds:g} s windows")
        for r in range(rounds):
            for path in rotated(window_order, r):
                for name, mover in testbed.movers.items():  # both start together
                    mover.send(
                        {
                            "op": "window",
                            "path": path,
                            "seconds": window_seconds,
                            "request_id": f"w{r}-{name}",
                        }
                    )
                results = {name: mover.result() for name, mover in testbed.movers.items()}
                windows[path].append(results)
                progress.advance(task)
    return summarize(testbed, runs, windows, rounds, window_seconds)


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def summarize(
    testbed: Testbed,
    runs: dict[str, list[dict[str, Any]]],
    windows: dict[str, list[dict[str, Any]]],
    rounds: int,
    window_seconds: float,
) -> dict[str, Any]:
    block_bytes = int(testbed.movers["a"].ready["block_bytes"])
    mb_per_second = {
        side: _median([r["bytes"] / r["seconds"] / MB for r in results])
        for side, results in runs.items()
    }
    write_only = {
        side: _median([r["bytes"] / r["write_seconds"] / MB for r in results])
        for side, results in runs.items()
        if side.startswith("redis")
    }
    # What the move cost in CPU, every process together: on a machine where CPU is the bound
    # (this one), MB/s follows it.
    per_cpu_second = {
        side: _median(
            [r["bytes"] / MB / max(1e-9, sum(r["cpu_seconds"].values())) for r in results]
        )
        for side, results in runs.items()
    }
    ratios = {
        f"x{s}": {
            "peer_vs_redis": mb_per_second[f"peer x{s}"] / mb_per_second[f"redis x{s}"],
            "peer_vs_redis_write_only": mb_per_second[f"peer x{s}"] / write_only[f"redis x{s}"],
            "peer_vs_redis_per_round": [
                (p["bytes"] / p["seconds"]) / (q["bytes"] / q["seconds"])
                for p, q in zip(runs[f"peer x{s}"], runs[f"redis x{s}"], strict=True)
            ],
        }
        for s in (1, WINDOW_STREAMS)
    }
    window_mb = {
        path: _median([sum(r["bytes"] for r in rnd.values()) / MB for rnd in results])
        for path, results in windows.items()
    }
    return {
        "link": testbed.link,
        "model_geometry": {
            "layers": SMOLLM2_135M.layers,
            "kv_heads": SMOLLM2_135M.kv_heads,
            "head_dim": SMOLLM2_135M.head_dim,
            "block_tokens": BLOCK_TOKENS,
            "dtype": "bfloat16",
        },
        "payload_bytes": SMOLLM2_135M.payload_bytes,
        "blocks_per_run": testbed.blocks,
        "bytes_per_run": block_bytes,
        "rounds": rounds,
        "cpus": os.cpu_count(),
        "mb_per_second_median": mb_per_second,
        "redis_write_only_mb_per_second_median": write_only,
        "mb_per_cpu_second_median": per_cpu_second,
        "ratios": ratios,
        "cpu_seconds_median": {
            side: {
                k: _median([r["cpu_seconds"][k] for r in results])
                for k in results[0]["cpu_seconds"]
            }
            for side, results in runs.items()
        },
        "two_nodes": {
            "window_seconds": window_seconds,
            "streams_per_source": WINDOW_STREAMS,
            "mb_moved_median": window_mb,
            "peer_vs_redis": window_mb["peer"] / window_mb["redis"],
            "gcp_30s_extrapolated_gb": {
                p: mb * 30 / window_seconds / 1000 for p, mb in window_mb.items()
            },
            "rounds": windows,
        },
        "runs": runs,
    }


def print_report(result: dict[str, Any], console: Console) -> None:
    rates = result["mb_per_second_median"]
    writes = result["redis_write_only_mb_per_second_median"]
    print_table(
        console,
        f"{result['blocks_per_run']} blocks of {result['payload_bytes']:,} payload bytes "
        f"({result['bytes_per_run'] / MB:.0f} MB) source -> target, median of {result['rounds']}",
        ("path", "MB/s", "Redis write alone", "MB per CPU s", "CPU s: source / target / redis"),
        [
            (
                side,
                f"{rates[side]:.0f}",
                f"{writes[side]:.0f}" if side in writes else "",
                f"{result['mb_per_cpu_second_median'][side]:.0f}",
                " / ".join(f"{v:.2f}" for v in result["cpu_seconds_median"][side].values()),
            )
            for side in SIDES
        ],
    )
    for streams, ratio in result["ratios"].items():
        console.print(
            f"peer / Redis, {streams}: {ratio['peer_vs_redis']:.2f} "
            f"(against the Redis write alone: {ratio['peer_vs_redis_write_only']:.2f})"
        )
    two = result["two_nodes"]
    moved = two["mb_moved_median"]
    console.print(
        f"two sources at once, {two['window_seconds']:g} s, {two['streams_per_source']} "
        f"streams each: peer {moved['peer']:.0f} MB, through one Redis {moved['redis']:.0f} MB "
        f"(written only) = {two['peer_vs_redis']:.2f}x; link: {result['link']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, model=False, rounds=3)
    parser.add_argument("--blocks", type=int, default=32, help="blocks moved per run")
    parser.add_argument("--window-seconds", type=float, default=10.0)
    parser.add_argument("--loopback", action="store_true", help="no namespaces: 127.0.0.1")
    args = parser.parse_args(argv)
    if shutil.which(REDIS_SERVER_BINARY) is None:
        parser.error("redis-server is not on PATH (Debian/Ubuntu: apt-get install redis-server)")
    console = Console()
    with tempfile.TemporaryDirectory(prefix="peer-migration-") as folder:
        testbed = Testbed(Path(folder), args.blocks, args.loopback)
        try:
            testbed.open(console)
            result = measure(testbed, args.rounds, args.window_seconds, console)
        finally:
            testbed.close()
    print_report(result, console)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
