"""The drill scenarios, picked by name. Each disturbs a running cluster while load flows.

A scenario runs in its own thread beside the load; it sees the live traces (to act once
requests are mid-stream) and acts through the cluster, which records every disturbance.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from spotinfer.loadgen import RequestTrace

MID_STREAM_TOKENS = 24  # a request "is mid-stream" once it has this many tokens
WAIT_MID_STREAM_SECONDS = 300.0


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
    say: Any = print

    def wait_mid_stream(self, fraction: float = 0.5, tokens: int = MID_STREAM_TOKENS) -> None:
        """Blocks until `fraction` of the started requests have `tokens` tokens (or load ends)."""
        deadline = time.monotonic() + WAIT_MID_STREAM_SECONDS
        while not self.done.is_set() and time.monotonic() < deadline:
            started = list(self.live)
            moving = [t for t in started if len(t.token_ids) >= tokens]
            if started and len(moving) >= fraction * len(started):
                return
            time.sleep(0.05)

    def scaled_grace(self) -> float:
        grace = (
            self.grace_seconds
            if self.grace_seconds is not None
            else self.cluster.config.grace_seconds
        )
        return grace * self.time_scale

    def preempt_then_terminate(self, names: Sequence[str]) -> list[threading.Timer]:
        """The notice now; the VM gone when the (scaled) grace period ends."""
        grace = self.scaled_grace()
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
        ctx.wait_mid_stream(tokens=140)  # past one KV block, so something was persisted
        ctx.cluster.kill(ctx.cluster.active_nodes()[0].name)


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
    """A preemption every `interval` seconds for `duration`; each lost node is replaced by a
    new standby, as a spot fleet's autoscaler would."""

    expect_zero_recompute = True

    def disturb(self, ctx: DrillContext) -> None:
        ctx.wait_mid_stream(fraction=0.1)
        end = time.monotonic() + ctx.duration_seconds
        while time.monotonic() < end and not ctx.done.is_set():
            active = ctx.cluster.active_nodes()
            if active:
                ctx.preempt_then_terminate([active[0].name])
                # The replacement loads in the background, as a new spot VM boots: the next
                # preemption keeps its cadence.
                threading.Thread(target=ctx.cluster.add_standby, daemon=True).start()
            ctx.done.wait(ctx.interval_seconds)


class Storm(Scenario, name="storm"):
    """Every active worker noticed at once, with fewer standbys than preempted workers:
    requests must queue and complete, none fail."""

    expect_zero_recompute = True

    def disturb(self, ctx: DrillContext) -> None:
        ctx.wait_mid_stream()
        ctx.preempt_then_terminate(
            [n.name for n in ctx.cluster.active_nodes() if n.role == "active"]
        )


class Trace(Scenario, name="trace"):
    """Replays a spot availability trace (SpotServe's format): `remove` is a notice with the
    grace period scaled like time, `add` a node joining as a standby."""

    expect_zero_recompute = True

    def disturb(self, ctx: DrillContext) -> None:
        if ctx.trace_file is None:
            raise ValueError("the trace scenario needs --trace FILE")
        entries = [
            json.loads(line) for line in ctx.trace_file.read_text().splitlines() if line.strip()
        ]
        start = time.monotonic()
        known: dict[str, str] = {}  # trace node name → cluster node name
        first_add = True
        for when_ms, action, payload in entries:
            ctx.done.wait(max(0.0, start + when_ms / 1000 * ctx.time_scale - time.monotonic()))
            if ctx.done.is_set() or action == "DONE":
                return
            if action == "add" and first_add:
                # The cluster's initial nodes stand for the trace's first nodes.
                for trace_name, node in zip(payload["nodes"], ctx.cluster.nodes, strict=False):
                    known[trace_name] = node
                first_add = False
            elif action == "add":
                # New VMs boot in the background; the trace's clock does not wait for them.
                for trace_name in payload["nodes"]:
                    threading.Thread(
                        target=_join, args=(ctx, known, trace_name), daemon=True
                    ).start()
            elif action == "remove":
                # A removed trace node we map preempts its node; one we don't (the trace has
                # more nodes than this cluster) preempts another serving node instead, so
                # every removal in the trace is a real preemption here.
                chosen: list[str] = []
                for trace_name in payload["nodes"]:
                    serving = [n.name for n in ctx.cluster.active_nodes() if n.name not in chosen]
                    mapped = known.get(trace_name)
                    if mapped is not None and mapped in serving:
                        chosen.append(mapped)
                    elif serving:
                        chosen.append(serving[0])
                if chosen:
                    ctx.preempt_then_terminate(chosen)


def _join(ctx: DrillContext, known: dict[str, str], trace_name: str) -> None:
    known[trace_name] = ctx.cluster.add_standby().name
