"""The drill timeline: per request, its tokens over time, coloured by the worker that made
them, with the cluster events (notices, kills, restarts) and the stream events (migrated,
recovered) marked."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from spotinfer.drills.report import ClusterEvent
from spotinfer.loadgen import RequestTrace

EVENT_COLOURS = {
    "notice": "tab:red",
    "sigterm": "tab:orange",
    "scale-in": "tab:pink",
    "drain": "tab:olive",
    "kill": "black",
    "redis-restart": "tab:purple",
    "coordinator-restart": "tab:brown",
    "join": "tab:green",
}


def plot_timeline(
    traces: Sequence[RequestTrace],
    events: Sequence[ClusterEvent],
    out: Path,
    title: str,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = min((t.sent_at for t in traces), default=0.0)
    workers = sorted({w for t in traces for w in t.token_workers if w})
    palette = plt.get_cmap("tab10")
    colour = {w: palette(i % 10) for i, w in enumerate(workers)}
    height = max(3.0, min(0.18 * len(traces) + 1.5, 14.0))
    fig, ax = plt.subplots(figsize=(12, height))
    for row, trace in enumerate(traces):
        ax.plot(
            [trace.sent_at - start, (trace.token_times or [trace.sent_at])[0] - start],
            [row, row],
            color="0.85",
            lw=1,
        )
        for worker in workers:
            xs = [
                tm - start
                for tm, w in zip(trace.token_times, trace.token_workers, strict=False)
                if w == worker
            ]
            if xs:
                ax.scatter(xs, [row] * len(xs), s=2, color=colour[worker])
        for event in trace.events:
            marker = {"migrated": ">", "recovered": "*"}.get(event.kind)
            if marker:
                ax.scatter(
                    [event.time - start], [row], marker=marker, s=40, color="tab:red", zorder=3
                )
        if not trace.ok:
            ax.scatter(
                [(trace.token_times or [trace.sent_at])[-1] - start], [row], marker="x", color="red"
            )
    for cluster_event in events:
        ax.axvline(
            cluster_event.time - start,
            color=EVENT_COLOURS.get(cluster_event.kind, "tab:gray"),
            ls="--",
            lw=1,
        )
        ax.annotate(
            f"{cluster_event.kind} {cluster_event.target}",
            (cluster_event.time - start, len(traces) - 0.5),
            rotation=90,
            fontsize=7,
            va="top",
        )
    for worker in workers:
        ax.scatter([], [], color=colour[worker], label=worker)
    ax.scatter([], [], marker=">", color="tab:red", label="migrated")
    ax.scatter([], [], marker="*", color="tab:red", label="recovered")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("request")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=7, markerscale=3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
