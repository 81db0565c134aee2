"""A trace's fleet mapped onto the local one by fraction, not by node name.

A trace names its nodes (node-0 … node-10 in SpotServe's A_S); the local cluster has a few.
Mapping names one to one would make a wave's weight depend on which names the cluster
happens to hold: a removal of 2 of 10 trace nodes could take every local node, or none.
Here each wave keeps its share:

    trace fleet 10 ──remove 2 (20%)──▶ 8        local serving 5 ──▶ preempt round(20% × 5) = 1
    trace fleet  8 ──add 2──────────▶ 10        local target round(10 × 4/7) = 6 ──▶ join
                                                 6 − (live + booting)

The ratio is fixed by the first wave: the cluster's initial nodes stand for the trace's
initial nodes. A removal takes at least one node (each trace removal is a real preemption
here) and, unless the trace loses every node, leaves at least one serving (so a cluster
down to one serving node lets a partial wave pass, and says so); a wave of the whole trace
fleet takes the whole local one (a correlated wave). Each wave's mapping is
said in a note for the report.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class TraceScale:
    """The trace's live nodes against the local fleet (live or booting nodes)."""

    ratio: float  # local nodes per trace node
    trace_nodes: set[str] = field(default_factory=set)
    local_nodes: int = 0
    notes: list[str] = field(default_factory=list)

    @classmethod
    def first_wave(cls, trace_names: Iterable[str], local_nodes: int) -> TraceScale:
        names = set(trace_names)
        if not names or local_nodes < 1:
            raise ValueError("a trace's first wave and the local cluster need a node each")
        scale = cls(ratio=local_nodes / len(names), trace_nodes=names, local_nodes=local_nodes)
        scale.notes.append(
            f"trace mapped by fraction: its {len(names)} first nodes are the cluster's "
            f"{local_nodes} ({scale.ratio:.2f} local nodes per trace node)"
        )
        return scale

    def add(self, trace_names: Iterable[str], at_seconds: float) -> int:
        """Trace nodes joined: how many local nodes to boot (to the scaled fleet size)."""
        names = set(trace_names) - self.trace_nodes
        self.trace_nodes |= names
        target = max(1, round(len(self.trace_nodes) * self.ratio))
        joins = max(0, target - self.local_nodes)
        self.local_nodes += joins
        self.notes.append(
            f"{at_seconds:g} s: trace adds {len(names)} (fleet {len(self.trace_nodes)}) → "
            f"{joins} local join(s) (fleet {self.local_nodes}, target {target})"
        )
        return joins

    def remove(self, trace_names: Iterable[str], serving: int, at_seconds: float) -> int:
        """Trace nodes taken: how many of the ``serving`` local nodes to notice, the same
        share of the local fleet as of the trace's."""
        names = set(trace_names) & self.trace_nodes
        before = len(self.trace_nodes)
        self.trace_nodes -= names
        if not names or serving < 1:
            return 0
        share = len(names) / before
        if share >= 1:
            taken = serving
        elif serving > 1:
            taken = min(serving - 1, max(1, round(share * serving)))
        else:
            taken = 0  # one node cannot lose a share smaller than all of it
        self.local_nodes = max(0, self.local_nodes - taken)
        self.notes.append(
            f"{at_seconds:g} s: trace removes {len(names)} of {before} ({share:.0%}) → "
            f"{taken} of {serving} local serving node(s) noticed ({taken / serving:.0%})"
        )
        return taken
