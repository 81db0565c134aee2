"""Runs one drill: load through the coordinator, a scenario disturbing the cluster, then the
verdict on every invariant (see `spotinfer.drills.report`).

    load thread ──── requests stream through the coordinator ─────────────▶ traces
    scenario thread ───── wait mid-stream ── notice / kill / restart ──▶ cluster events
    afterwards: reference outputs (the same requests on an undisturbed worker: greedy, or
                seeded sampling with the same seeds),
                leak check in Redis, report + timeline PNG
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from spotinfer.drills.report import DrillReport, build_report
from spotinfer.drills.scenarios import DrillContext, scenario_named
from spotinfer.drills.timeline import plot_timeline
from spotinfer.loadgen import (
    LoadSpec,
    PlannedRequest,
    RequestTrace,
    Sampling,
    plan_requests,
    run_load,
)
from worker.constants import DEFAULT_KV_CHUNK_TOKENS

if TYPE_CHECKING:
    import redis

LEAK_WAIT_SECONDS = 20.0
# Workers persist KV in chunks of this many tokens (--kv-chunk-tokens): an unannounced loss
# recomputes less than one chunk.
KV_CHUNK_TOKENS = DEFAULT_KV_CHUNK_TOKENS
# A node taken away: noticed, stopped (SIGTERM), drained, scaled in by its group, or killed.
PREEMPTION_EVENTS = frozenset({"notice", "sigterm", "drain", "scale-in", "kill"})


@dataclass(frozen=True)
class DrillOptions:
    scenario: str
    requests: int = 16
    rate_per_second: float = 0.0  # 0: all at once
    prompt_tokens: tuple[int, int] = (32, 96)
    output_tokens: tuple[int, int] = (200, 300)
    time_scale: float = 1.0
    grace_seconds: float | None = None
    interval_seconds: float = 30.0
    duration_seconds: float = 300.0
    trace_file: Path | None = None
    first_disturbance_seconds: float | None = None  # rolling; None: once mid-stream
    seed: int = 0
    block_tokens: int = KV_CHUNK_TOKENS
    ignore_eos: bool = True  # fixed lengths for load; real answers stop at EOS
    # greedy, or seeded: temperature 1 with a seed per request, checked like greedy output
    # (a migration or a recovery must continue the same random sequence)
    sampling: Sampling = Sampling.GREEDY


@dataclass
class DrillOutcome:
    report: DrillReport
    traces: list[RequestTrace]
    references: dict[str, list[int]]
    png: Path | None = None


def plan(options: DrillOptions, vocab_size: int, prefix: str = "") -> list[PlannedRequest]:
    """The drill's requests, the same for the same options (seeded); ids start with `prefix`
    (default: the scenario and the time, unique per drill)."""
    spec = LoadSpec(
        num_requests=options.requests,
        rate_per_second=options.rate_per_second,
        prompt_tokens=options.prompt_tokens,
        output_tokens=options.output_tokens,
        vocab_high=vocab_size,
        seed=options.seed,
        sampling=options.sampling,
    )
    return plan_requests(spec, prefix=prefix or f"drill-{options.scenario}-{int(time.time())}")


def _unbounded_reason(policy: str, persist_policy: str) -> str:
    """Why an abrupt loss's recompute is not held to one chunk ("" when it is, or when the
    failover policy restarts from scratch anyway)."""
    if policy != "spotinfer" or persist_policy == "eager":
        return ""
    return (
        f"the workers persist KV {persist_policy} (not every block as it fills): an abrupt "
        "loss recomputes what was not stored yet"
    )


def run_drill(
    cluster: object,
    options: DrillOptions,
    planned: Sequence[PlannedRequest],
    png: Path | None = None,
    say: Callable[[str], None] = print,
    on_done: Callable[[RequestTrace], None] | None = None,
) -> DrillOutcome:
    """`on_done` is told of each request as it completes (a progress display)."""
    from spotinfer.local.cluster import LocalCluster

    assert isinstance(cluster, LocalCluster)
    scenario = scenario_named(options.scenario)
    if options.grace_seconds is not None and not cluster.config.notice_has_deadline:
        raise ValueError(
            f"a {cluster.config.cloud.upper()} notice carries no deadline, so a drill grace "
            "cannot be honoured: start the cluster with --notice-seconds instead"
        )
    ctx = DrillContext(
        cluster=cluster,
        time_scale=options.time_scale,
        grace_seconds=options.grace_seconds,
        interval_seconds=options.interval_seconds,
        duration_seconds=options.duration_seconds,
        trace_file=options.trace_file,
        first_disturbance_seconds=options.first_disturbance_seconds,
        say=say,
        prompt_tokens=options.prompt_tokens,
        output_tokens=options.output_tokens,
        chunk_tokens=options.block_tokens,
    )
    traces: list[RequestTrace] = []
    failure: list[BaseException] = []

    def load() -> None:
        try:
            traces.extend(
                asyncio.run(
                    run_load(
                        cluster.coordinator.address,
                        planned,
                        service="inference",
                        ignore_eos=options.ignore_eos,
                        on_start=ctx.live.append,
                        on_done=on_done,
                        transport=cluster.client_transport,
                        api_key=cluster.api_key,
                    )
                )
            )
        finally:
            ctx.done.set()

    def disturb() -> None:
        try:
            scenario.disturb(ctx)
        except BaseException as exc:  # reported after the load, never swallowed
            failure.append(exc)

    load_thread = threading.Thread(target=load, name="drill-load")
    disturb_thread = threading.Thread(target=disturb, name="drill-scenario", daemon=True)
    ctx.load_started = time.monotonic()  # the scenario's schedule counts from here
    load_thread.start()
    disturb_thread.start()
    load_thread.join()
    disturb_thread.join(timeout=60)
    failure.extend(ctx.failures)
    if failure:
        raise failure[0]
    say(f"{len(traces)} request(s) done; computing reference outputs on an undisturbed worker")
    references = reference_outputs(cluster, planned, options.ignore_eos)
    admin = cluster.redis_admin_client()  # every master of a Redis Cluster
    try:
        release_requests(admin, [f"ref-{p.request_id}" for p in planned])
        leaked = leaked_keys(admin, [p.request_id for p in planned])
    finally:
        admin.close()
    report = build_report(
        scenario=options.scenario,
        policy=cluster.config.policy,
        traces=traces,
        reference=references,
        leaked_keys=leaked,
        block_tokens=options.block_tokens,
        expect_zero_recompute=scenario.expect_zero_recompute
        and cluster.config.policy == "spotinfer"
        and cluster.config.persist_policy != "off",
        bounded_recompute=cluster.config.policy == "spotinfer"
        and cluster.config.persist_policy == "eager",
        unbounded_reason=_unbounded_reason(cluster.config.policy, cluster.config.persist_policy),
        preemptions=sum(1 for e in cluster.events if e.kind in PREEMPTION_EVENTS),
        mac_rejected_blocks=cluster.mac_rejected_blocks(),
    )
    report.notes.extend(ctx.notes)
    if options.time_scale != 1.0:
        report.notes.append(f"time scaled ×{options.time_scale:g} (grace periods too)")
        if not cluster.config.notice_has_deadline:
            report.notes.append(
                f"{cluster.config.cloud.upper()} notices carry no deadline: a noticed VM lived "
                f"its daemon's {cluster.config.grace_seconds:g} s, not scaled"
            )
    outcome = DrillOutcome(report=report, traces=traces, references=references)
    if png is not None:
        outcome.png = plot_timeline(
            traces, cluster.events, png, f"{options.scenario} drill ({cluster.config.policy})"
        )
    return outcome


def reference_outputs(
    cluster: object, planned: Sequence[PlannedRequest], ignore_eos: bool = True
) -> dict[str, list[int]]:
    """The same requests (greedy, or with the same seeds) on one undisturbed worker,
    straight through Worker.Generate."""
    from spotinfer.local.cluster import LocalCluster

    assert isinstance(cluster, LocalCluster)
    serving = cluster.active_nodes()
    if not serving:
        cluster.add_standby()
        serving = cluster.active_nodes()
    if not serving:
        raise RuntimeError("no worker left to compute the reference outputs on")
    reference_plan = [
        PlannedRequest(
            request_id=f"ref-{p.request_id}",
            send_offset_seconds=0.0,
            prompt_token_ids=p.prompt_token_ids,
            max_tokens=p.max_tokens,
            sla_class=p.sla_class,
            temperature=p.temperature,
            sampling_seed=p.sampling_seed,
        )
        for p in planned
    ]
    traces = asyncio.run(
        run_load(
            serving[0].worker.address,
            reference_plan,
            service="worker",
            ignore_eos=ignore_eos,
            transport=cluster.operator_transport,
        )
    )
    return {p.request_id: t.token_ids for p, t in zip(planned, traces, strict=True) if t.ok}


def release_requests(client: redis.Redis | redis.RedisCluster, request_ids: Sequence[str]) -> None:
    """What a coordinator does once its client got a request's end, for requests no
    coordinator relayed (the references, straight from a worker): the store may let their
    keys go (store.RedisStore.release_request), else it keeps them for the undelivered
    retention. ``client``: the operator's (a cluster client sends each to its key's master)."""
    from store import keys
    from store.lua_scripts import RELEASE_REQUEST

    for request_id in request_ids:
        request_keys = keys.request_keys(request_id)
        client.eval(RELEASE_REQUEST.source, len(request_keys), *request_keys, 0)


def leaked_keys(client: redis.Redis | redis.RedisCluster, request_ids: Sequence[str]) -> int:
    """Keys of these (finished) requests still in Redis after the retention, plus any key of
    ours that would never expire, on every master a cluster ``client`` reaches. Waits a
    little: finishing is asynchronous."""
    from store import keys

    deadline = time.monotonic() + LEAK_WAIT_SECONDS
    while True:
        ours = [k.decode() for k in client.scan_iter(match=keys.schema_pattern(), count=1000)]
        owned = [
            k
            for k in ours
            if any(f"{{{rid}}}" in k or f"{{ref-{rid}}}" in k for rid in request_ids)
        ]
        immortal = [k for k in ours if client.ttl(k) == -1]
        leaked = set(owned) | set(immortal)
        if not leaked or time.monotonic() > deadline:
            return len(leaked)
        time.sleep(0.5)
