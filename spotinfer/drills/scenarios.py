"""The drill scenarios, picked by name. Each disturbs a running cluster while load flows.

A scenario runs in its own thread beside the load; it sees the live traces (to act once
requests are mid-stream) and acts through the cluster, which records every disturbance.

Scheduled scenarios (rolling, trace) keep their clock from the moment the load starts, so
two drills on the same planned load see the same disturbances at the same offsets:

    load start ── first ──▶ notice ── interval ──▶ notice ── interval ──▶ …   (rolling)
    load start ──────── trace time × time_scale ──▶ add / remove …           (trace)
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from spotinfer.drills.trace_scale import TraceScale
from spotinfer.loadgen import RequestTrace

MID_STREAM_TOKENS = 24  # a request "is mid-stream" once it has this many tokens
WAIT_MID_STREAM_SECONDS = 300.0
# abrupt: tokens kept between the kill and the first chunk boundary (short outputs)
KILL_MARGIN_TOKENS = 32
# correlated: every spot node's notice within this many seconds of the first
CORRELATED_WAVE_SECONDS = 1.5


@dataclass
class DrillContext:
    cluster: Any  # spotinfer.local.cluster.LocalCluster
    live: list[RequestTrace] = field(default_factory=list)  # traces as they start
    done: threading.Event = field(default_factory=threading.Event)  # the load has finished
    time_scale: float = 1.0  # grace periods (and trace times) are multiplied by this
    grace_seconds: float | None = None  # overrides the cloud's default before scaling
    interval_seconds: float = 30.0  # rolling: a preemption every this many seconds
    duration_seconds: float = 300.0  # rolling: for this long
    trace_file: Path | None = None
    # rolling: the first notice this long after the load starts; None: once requests are
    # mid-stream (a fixed offset gives two drills the same schedule)
    first_disturbance_seconds: float | None = None
    load_started: float = field(default_factory=time.monotonic)  # time.monotonic()
    # errors of background work (nodes joining); the runner raises the first after the load
    failures: list[BaseException] = field(default_factory=list)
    say: Any = print
    # The planned load's prompt and output lengths (low, high) and the KV chunk size: where
    # a scenario's disturbance lands relative to what is persisted.
    prompt_tokens: tuple[int, int] = (32, 96)
    output_tokens: tuple[int, int] = (200, 300)
    chunk_tokens: int = 256
    notes: list[str] = field(default_factory=list)  # for the report

    def wait_mid_stream(self, fraction: float = 0.5, tokens: int = MID_STREAM_TOKENS) -> None:
        """Blocks until `fraction` of the started requests (and at least one) have `tokens`
        tokens, or the load ends."""
        deadline = time.monotonic() + WAIT_MID_STREAM_SECONDS
        while not self.done.is_set() and time.monotonic() < deadline:
            started = list(self.live)
            moving = [t for t in started if len(t.token_ids) >= tokens]
            if started and len(moving) >= max(1.0, fraction * len(started)):
                return
            time.sleep(0.05)

    def wait_until(self, offset_seconds: float) -> bool:
        """Sleeps until `offset_seconds` after the load started; False if the load ended."""
        remaining = self.load_started + offset_seconds - time.monotonic()
        return not self.done.wait(max(0.0, remaining))

    def in_background(self, work: Callable[..., object], *args: Any) -> None:
        """Runs `work(*args)` on a daemon thread (a VM booting does not stop the clock);
        an error is kept for the runner to raise."""

        def run() -> None:
            try:
                work(*args)
            except BaseException as exc:
                self.failures.append(exc)

        threading.Thread(
            target=run, name=f"drill-{getattr(work, '__name__', 'work')}", daemon=True
        ).start()

    def scaled_grace(self) -> float:
        """The drill's grace (or the cloud's) times the time scale: a drain's deadline, and a
        notice's where the notice carries it (see `notice_grace`)."""
        config = self.cluster.config
        grace = self.grace_seconds if self.grace_seconds is not None else config.grace_seconds
        return float(grace) * self.time_scale

    def notice_grace(self) -> float:
        """How long a noticed VM lives: the scaled grace, but where a notice carries no
        deadline (GCP) the notice length its daemon was configured with, which no drill
        option can shorten (the runner refuses a drill grace there)."""
        config = self.cluster.config
        return self.scaled_grace() if config.notice_has_deadline else float(config.grace_seconds)

    def preempt_then_terminate(self, names: Sequence[str]) -> list[threading.Timer]:
        """The notice now; the VM gone when the notice's grace period ends."""
        grace = self.notice_grace()
        timers = []
        for name in names:
            self.cluster.preempt(name, grace)
            timer = threading.Timer(grace, self.cluster.terminate, args=(name,))
            timer.daemon = True
            timer.start()
            timers.append(timer)
        self.say(f"notice to {', '.join(names)}; grace {grace:g} s")
        return timers


class Scenario:
    """`disturb(ctx)` acts on the cluster while the load runs; it must return."""

    registry: ClassVar[dict[str, type[Scenario]]] = {}
    name: ClassVar[str] = ""
    expect_zero_recompute: ClassVar[bool] = False  # only when every loss was announced
    needs_standbys: ClassVar[int] = 1

    def __init_subclass__(cls, name: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name:
            cls.name = name
            Scenario.registry[name] = cls

    def disturb(self, ctx: DrillContext) -> None:
        raise NotImplementedError


def scenario_named(name: str) -> Scenario:
    if name not in Scenario.registry:
        raise KeyError(f"unknown scenario {name!r}; known: {', '.join(sorted(Scenario.registry))}")
    return Scenario.registry[name]()


class Notice(Scenario, name="notice"):
    """One worker gets a termination notice in its cloud's format."""

    expect_zero_recompute = True

    def disturb(self, ctx: DrillContext) -> None:
        ctx.wait_mid_stream()
        ctx.preempt_then_terminate([ctx.cluster.active_nodes()[0].name])


class Abrupt(Scenario, name="abrupt"):
    """SIGKILL of a serving worker, no notice."""

    def disturb(self, ctx: DrillContext) -> None:
        ctx.wait_mid_stream(tokens=self.kill_tokens(ctx))
        ctx.cluster.kill(ctx.cluster.active_nodes()[0].name)

    @staticmethod
    def kill_tokens(ctx: DrillContext) -> int:
        """Generated tokens at which the worker dies: half a chunk after the requests' first
        KV chunk filled, so each recovery has a stored chunk to load, with a chunk's worth of
        tokens left for the requests that run ahead. Outputs too short for that: before any
        chunk fills, and the report says nothing was stored to load."""
        chunk = ctx.chunk_tokens
        (prompt_low, prompt_high), output_low = ctx.prompt_tokens, ctx.output_tokens[0]
        kill = chunk - prompt_low + chunk // 2
        if kill + chunk <= output_low:
            return kill
        ctx.notes.append(
            f"outputs of {output_low}+ tokens end before a {chunk}-token KV chunk is safely "
            "stored: the kill came before any chunk filled, so each recovery recomputed its "
            "whole (shorter than a chunk) context"
        )
        return max(MID_STREAM_TOKENS, chunk - prompt_high - KILL_MARGIN_TOKENS)


class Sigterm(Scenario, name="sigterm"):
    """The service manager stops a serving worker (SIGTERM: a GCP managed group's delete, a
    shutdown, an operator's `systemctl stop`): its requests move as on a notice."""

    expect_zero_recompute = True

    def disturb(self, ctx: DrillContext) -> None:
        ctx.wait_mid_stream()
        name = ctx.cluster.active_nodes()[0].name
        ctx.cluster.stop_worker(name)
        ctx.say(f"SIGTERM to {name}")


class Drain(Scenario, name="drain"):
    """An operator drains a serving worker (`Control.Drain`): its requests move as on a
    notice, with the (scaled) grace as the deadline."""

    expect_zero_recompute = True

    def disturb(self, ctx: DrillContext) -> None:
        ctx.wait_mid_stream()
        name = ctx.cluster.active_nodes()[0].name
        moving = ctx.cluster.drain(name, ctx.scaled_grace())
        ctx.say(f"drain of {name}: {moving} request(s) in flight")


class ScaleIn(Scenario, name="scale-in"):
    """The auto scaling group terminates a serving node itself (scale-in, instance refresh):
    no spot notice, only `autoscaling/target-lifecycle-state` = Terminated in its metadata
    (AWS); the lifecycle hook holds it for the grace, then it is gone."""

    expect_zero_recompute = True

    def disturb(self, ctx: DrillContext) -> None:
        ctx.wait_mid_stream()
        name = ctx.cluster.active_nodes()[0].name
        ctx.cluster.scale_in(name)
        grace = ctx.cluster.config.scale_in_seconds
        timer = threading.Timer(grace, ctx.cluster.terminate, args=(name,))
        timer.daemon = True
        timer.start()
        ctx.say(f"scale-in of {name}; the hook holds it {grace:g} s")


class RedisRestart(Scenario, name="redis-restart"):
    """The store vanishes mid-generation and comes back empty."""

    needs_standbys = 0

    def disturb(self, ctx: DrillContext) -> None:
        ctx.wait_mid_stream()
        ctx.cluster.restart_redis()


class CoordinatorRestart(Scenario, name="coordinator-restart"):
    """The coordinator dies mid-stream and restarts on the same port; clients re-Attach."""

    needs_standbys = 0

    def disturb(self, ctx: DrillContext) -> None:
        ctx.wait_mid_stream()
        ctx.cluster.restart_coordinator()


class Rolling(Scenario, name="rolling"):
    """A preemption every `interval` seconds for `duration`, from the first one on (see
    `rolling_schedule`); each lost node is replaced by a new standby, as a spot fleet's
    autoscaler would. The replacement boots in the background: the cadence never waits for
    it, so an interval shorter than a boot drains the cluster (as it would a real fleet)."""

    expect_zero_recompute = True

    def disturb(self, ctx: DrillContext) -> None:
        if ctx.first_disturbance_seconds is None:
            ctx.wait_mid_stream(fraction=0.1)
            first = time.monotonic() - ctx.load_started
        else:
            first = ctx.first_disturbance_seconds
        for offset in rolling_schedule(first, ctx.interval_seconds, ctx.duration_seconds):
            if not ctx.wait_until(offset):
                return
            serving = ctx.cluster.active_nodes()
            if serving:
                ctx.preempt_then_terminate([serving[0].name])
                ctx.in_background(ctx.cluster.add_standby)
            else:
                ctx.say(f"no serving node to preempt at {offset:.0f} s")


def rolling_schedule(first: float, interval: float, duration: float) -> list[float]:
    """Offsets from the load start: `first`, then every `interval` while < first + duration."""
    if interval <= 0:
        raise ValueError("the rolling interval must be positive")
    count = max(1, math.ceil(duration / interval))
    return [first + k * interval for k in range(count)]


class Storm(Scenario, name="storm"):
    """Every active worker noticed at once, with fewer standbys than preempted workers:
    requests must queue and complete, none fail."""

    expect_zero_recompute = True

    def disturb(self, ctx: DrillContext) -> None:
        ctx.wait_mid_stream()
        ctx.preempt_then_terminate(
            [n.name for n in ctx.cluster.active_nodes() if n.role == "active"]
        )


class Correlated(Scenario, name="correlated"):
    """A pool-wide reclaim: every spot node (active and standby) gets its notice within
    `CORRELATED_WAVE_SECONDS` of the first, as spot VMs of one type in one zone mostly do.
    Only an on-demand fallback node (if the cluster has one) is left to move to; spot
    capacity comes back as one replacement node that boots in the background, within the
    coordinator's capacity wait, so without a fallback the moving requests wait for it."""

    expect_zero_recompute = True

    def disturb(self, ctx: DrillContext) -> None:
        ctx.wait_mid_stream()
        wave = [n.name for n in ctx.cluster.spot_nodes()]
        gap = CORRELATED_WAVE_SECONDS / max(1, len(wave) - 1)
        for i, name in enumerate(wave):
            if i:
                time.sleep(gap)
            ctx.preempt_then_terminate([name])
        fallback = [n.name for n in ctx.cluster.active_nodes() if n.fallback]
        ctx.notes.append(
            f"correlated wave: {len(wave)} spot node(s) noticed within "
            f"{CORRELATED_WAVE_SECONDS:g} s; on-demand fallback: {', '.join(fallback) or 'none'}"
        )
        ctx.in_background(ctx.cluster.add_standby)


class ZoneOutage(Scenario, name="zone"):
    """Every spot node of one zone (the first serving node's) noticed at once: its requests
    must move to the other zones, not to a node of the zone that is going."""

    expect_zero_recompute = True

    def disturb(self, ctx: DrillContext) -> None:
        zones = ctx.cluster.config.zones
        if len(zones) < 2:
            raise ValueError("the zone scenario needs a cluster over two zones (--zones a,b)")
        ctx.wait_mid_stream()
        zone = ctx.cluster.spot_nodes()[0].zone
        wave = [n.name for n in ctx.cluster.spot_nodes() if n.zone == zone]
        ctx.notes.append(f"zone {zone} lost: {', '.join(wave)} noticed")
        ctx.preempt_then_terminate(wave)


class Trace(Scenario, name="trace"):
    """Replays a spot availability trace (SpotServe's format) mapped onto the cluster by
    fraction (`TraceScale`): `remove` notices the same share of the serving nodes, with the
    grace period scaled like time; `add` boots nodes as standbys up to the scaled fleet
    size. The report's notes say how each wave mapped."""

    expect_zero_recompute = True

    def disturb(self, ctx: DrillContext) -> None:
        if ctx.trace_file is None:
            raise ValueError("the trace scenario needs --trace FILE")
        scale: TraceScale | None = None
        try:
            for when_ms, action, payload in read_trace(ctx.trace_file):
                at = when_ms / 1000
                if not ctx.wait_until(at * ctx.time_scale) or action == "DONE":
                    return
                names = payload["nodes"]
                if scale is None:
                    if action != "add":
                        raise ValueError(f"the trace starts with {action!r}, not with its fleet")
                    # The cluster's initial nodes stand for the trace's first wave.
                    scale = TraceScale.first_wave(names, len(ctx.cluster.spot_nodes()))
                elif action == "add":
                    # New VMs boot in the background; the trace's clock does not wait.
                    for _ in range(scale.add(names, at)):
                        ctx.in_background(ctx.cluster.add_standby)
                elif action == "remove":
                    serving = [n.name for n in ctx.cluster.spot_nodes()]
                    taken = scale.remove(names, len(serving), at)
                    if taken:
                        # Active nodes first (active_nodes' order): the wave hits load.
                        ctx.preempt_then_terminate(serving[:taken])
        finally:
            if scale is not None:
                ctx.notes.extend(scale.notes)


def read_trace(path: Path) -> list[tuple[int, str, dict[str, Any]]]:
    """A SpotServe-format trace: one `[time_ms, action, {"nodes": [...]}]` per line."""
    entries = []
    for line in path.read_text().splitlines():
        if line.strip():
            when_ms, action, payload = json.loads(line)
            entries.append((int(when_ms), str(action), payload))
    return entries


def trace_span_seconds(path: Path) -> float:
    """Where the trace ends (its DONE, else its last entry), in trace seconds."""
    return max((when_ms for when_ms, _, _ in read_trace(path)), default=0) / 1000
