"""Hand-computed timelines on a tiny fleet (see factories: a step 0.1 s, a prompt token
0.01 s, 1 MB of KV per token, 100 MB/s, staging 0.5 s + MB/100, switch 0.2 s, boot 10 s).
One request, prompt 10 tokens; undisturbed it has its first token at 0.1 s (the prefill)
and one more every step."""

from __future__ import annotations

import pytest

from spotinfer.simulator.arrivals import SimRequest
from spotinfer.simulator.node import Market, NodeState
from spotinfer.simulator.simulation import ClusterAction
from spotinfer.simulator.traces import AvailabilityTrace, CapacityEvent
from tests.simulator.factories import autoscaled, scripted


def one_request(output_tokens: int) -> SimRequest:
    return SimRequest("r0", 0.0, prompt_tokens=10, output_tokens=output_tokens)


def test_undisturbed_request() -> None:
    request = one_request(11)
    sim = scripted("spotinfer", [request], [])
    assert request.first_token_at == pytest.approx(0.1)
    assert request.finished_at == pytest.approx(0.1 + 10 * 0.1)
    assert sim.counters.notices == 0


def test_notice_staged_migration() -> None:
    """Notice at 2.05 s: 20 tokens out, 30 of context, one full block (16 MB) in the store →
    staging 0.5 + 16 / 100 = 0.66 s while the source decodes; switch at 2.71 s with 27 tokens;
    the standby has it 0.2 s later, computes one token (0.01 s) — token 28 at 2.92 s — and the
    73 left by 10.22 s. Nothing recomputed."""
    request = one_request(101)
    sim = scripted("spotinfer", [request], [ClusterAction(2.05, "notice", "node-0")])
    assert request.finished_at == pytest.approx(2.92 + 73 * 0.1)
    assert request.migrations == 1
    assert request.recomputed_tokens == 0
    assert sim.counters.staged_switches == 1
    node_1 = sim.fleet.nodes[1]
    assert node_1.state == NodeState.ACTIVE  # promoted at the notice
    assert sim.fleet.nodes[0].deadline == pytest.approx(2.05 + 40.0)


def test_short_notice_flushes_then_loads() -> None:
    """A 5 s grace leaves no time to stage (< 10 s left): pause at 2.05 s with 20 tokens; the
    full block is stored already, the flush writes the 14-token tail (0.14 s); the standby loads
    all 30 MB (0.3 s) and computes one token (0.01 s): token 21 at 2.50 s, 80 more steps."""
    request = one_request(101)
    sim = scripted(
        "spotinfer", [request], [ClusterAction(2.05, "notice", "node-0")], grace_seconds=5.0
    )
    assert request.finished_at == pytest.approx(2.50 + 80 * 0.1)
    assert request.migrations == 1 and request.recomputed_tokens == 0
    assert sim.counters.flushed_moves == 1


def test_abrupt_loss_recovers_from_persisted_blocks() -> None:
    """Killed at 2.05 s with 20 tokens: 30 tokens of context, one full 16-token block in the
    store. The standby loads 16 MB (0.16 s), recomputes 14 tokens (0.14 s): token 21 at 2.35 s."""
    request = one_request(101)
    sim = scripted("spotinfer", [request], [ClusterAction(2.05, "kill", "node-0")])
    assert request.finished_at == pytest.approx(2.35 + 80 * 0.1)
    assert request.recoveries == 1
    assert request.recomputed_tokens == 14
    assert sim.fleet.nodes[0].gone_at == pytest.approx(2.05)


def test_reroute_restarts_from_the_prompt() -> None:
    """Noticed at 2.05 s with 20 tokens delivered: restarted on the standby from the prompt —
    prefill 0.1 s, then all 100 tokens again; the 30 tokens of prompt + delivered are
    recomputed (as the coordinator counts them)."""
    request = one_request(101)
    scripted("reroute", [request], [ClusterAction(2.05, "notice", "node-0")])
    assert request.finished_at == pytest.approx(2.15 + 100 * 0.1)
    assert request.first_token_at == pytest.approx(0.1)  # the client kept its first token
    assert request.restarts == 1
    assert request.recomputed_tokens == 30


def test_on_demand_fallback_when_spot_capacity_is_gone() -> None:
    """Zone a drops to 0 spot nodes at 5.05 s: the only node is noticed (30 s), no spot can be
    launched, so an on-demand node boots (ready at 15.05 s). With no target the request is
    paused at 50 tokens (60 of context; its 12-token tail stored at 5.17 s), waits, and is
    loaded by the on-demand node (60 MB, 0.6 s): token 51 at 15.66 s, then 949 steps."""
    request = one_request(1000)
    trace = AvailabilityTrace("drop", {"a": 1}, (CapacityEvent(5.05, "a", 0),), 0.0)
    sim = autoscaled("spotinfer", [request], trace)
    spot, fallback = sim.fleet.nodes
    assert (spot.market, fallback.market) == (Market.SPOT, Market.ON_DEMAND)
    assert fallback.launched_at == pytest.approx(5.05)
    assert spot.gone_at == pytest.approx(35.05)
    assert request.finished_at == pytest.approx(15.66 + 949 * 0.1)
    assert request.recomputed_tokens == 0


def test_without_fallback_the_request_waits_for_spot_capacity() -> None:
    """The same drop under reroute (no fallback): capacity comes back at 60 s, a spot node boots
    until 70 s, and the request (its node gone at 35.05 s) restarts there from the prompt."""
    request = one_request(1000)
    trace = AvailabilityTrace(
        "drop and back", {"a": 1}, (CapacityEvent(5.05, "a", 0), CapacityEvent(60.0, "a", 1)), 0.0
    )
    sim = autoscaled("reroute", [request], trace)
    assert all(n.market == Market.SPOT for n in sim.fleet.nodes)
    assert sim.fleet.nodes[1].launched_at == pytest.approx(60.0)
    assert request.finished_at == pytest.approx(70.0 + 0.1 + 999 * 0.1)


def test_no_on_demand_while_spot_holds_the_load() -> None:
    """Two nodes wanted, one light request (1,500 tokens: 37.6 s of a node at a full batch of 4,
    so 0.78 of a node at the 80% target): when the zone drops to one spot node at 100 s (the
    autoscaler measured at 60 s that one node holds the load), no on-demand node is bought and
    the request moves to the node that stays."""
    request = one_request(1500)
    trace = AvailabilityTrace("drop", {"a": 2}, (CapacityEvent(100.0, "a", 1),), 0.0)
    sim = autoscaled("spotinfer", [request], trace, nodes=2)
    assert all(n.market == Market.SPOT for n in sim.fleet.nodes)
    assert sim.counters.notices == 1
    assert request.finished_at is not None and request.recomputed_tokens == 0
