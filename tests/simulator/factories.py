"""Small deterministic set-ups for the simulator's tests: a calibration with round numbers
(a step 0.1 s whatever the batch, a prompt token 0.01 s, 1 MB of KV per token, 100 MB/s
everywhere) and one-line simulations."""

from __future__ import annotations

from collections.abc import Sequence

from spotinfer.simulator.arrivals import SimRequest
from spotinfer.simulator.calibration import Calibration
from spotinfer.simulator.fleet import FleetSpec
from spotinfer.simulator.node import NodeState
from spotinfer.simulator.policies import Policy
from spotinfer.simulator.simulation import ClusterAction, InitialNode, SimConfig, Simulation
from spotinfer.simulator.traces import AvailabilityTrace, unlimited


def calibration(**overrides: float) -> Calibration:
    values: dict[str, float] = {
        "step_base_seconds": 0.1,
        "step_per_seq_seconds": 0.0,
        "step_per_context_token_seconds": 0.0,
        "prefill_per_token_seconds": 0.01,
        "max_num_seqs": 4,
        "kv_bytes_per_token": 1_000_000,
        "block_tokens": 16,
        "store_write_mb_per_second": 100.0,
        "store_read_mb_per_second": 100.0,
        "peer_mb_per_second": 100.0,
        "staging_overhead_seconds": 0.5,
        "switch_downtime_seconds": 0.2,
        "boot_seconds": 10.0,
        "request_overhead_seconds": 0.0,
    }
    values.update(overrides)
    return Calibration(name="test", **values)  # type: ignore[arg-type]


def two_nodes() -> tuple[InitialNode, ...]:
    return (InitialNode("node-0", NodeState.ACTIVE), InitialNode("node-1", NodeState.STANDBY))


def scripted(
    policy: str,
    requests: Sequence[SimRequest],
    script: Sequence[ClusterAction],
    grace_seconds: float = 40.0,
    **calibration_overrides: float,
) -> Simulation:
    sim = Simulation(
        SimConfig(FleetSpec(1, 1, autoscale=False), grace_seconds=grace_seconds),
        calibration(**calibration_overrides),
        Policy.create(policy),
        requests,
        unlimited(("a",), 0.0),
        script=script,
        initial=two_nodes(),
    )
    sim.run()
    return sim


def autoscaled(
    policy: str,
    requests: Sequence[SimRequest],
    trace: AvailabilityTrace,
    nodes: int = 1,
    standbys: int = 0,
    grace_seconds: float = 30.0,
) -> Simulation:
    sim = Simulation(
        SimConfig(FleetSpec(nodes, standbys), grace_seconds=grace_seconds),
        calibration(),
        Policy.create(policy),
        requests,
        trace,
    )
    sim.run()
    return sim
