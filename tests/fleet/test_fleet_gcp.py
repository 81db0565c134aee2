"""The GCP rehearsal: the startup script (metadata.google.internal, Memorystore's CA in the
URL) boots two nodes, and a preemption on one node's metadata server moves its requests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spotinfer.rehearsal.streams import Streams, plan, verdict
from tests.fleet.fleet_support import (
    NOTICE_AFTER_TOKENS,
    NOTICE_OUTPUT,
    VOCAB_SIZE,
    booted_fleet,
    busiest,
    every_stream_past,
    notice_streams,
    wait_for,
)

pytestmark = [
    pytest.mark.usefixtures("namespaces"),
    # Not yet run by default: the rehearsal's boot does not provision the TLS bundle, the API
    # keys and the KV MAC keyring that the boot templates and the store now require off
    # loopback, and the notice and coordinator-restart tests were not yet stable.
    pytest.mark.skipif(
        os.environ.get("SPOTINFER_TEST_REHEARSAL") != "1",
        reason="the fleet rehearsal does not yet boot with TLS, keys and the KV MAC keyring; "
        "set SPOTINFER_TEST_REHEARSAL=1 to run it",
    ),
]


def test_a_gcp_preemption_migrates_the_nodes_requests_with_nothing_recomputed(
    tiny_model: Path, tmp_path: Path
) -> None:
    with booted_fleet(tiny_model, tmp_path, "gcp", 2) as fleet:
        assert all(vm.worker_id.startswith("spotinfer-node") for vm in fleet.nodes)
        assert all("ssl_ca_certs=" in vm.environment["SPOTINFER_REDIS_URL"] for vm in fleet.nodes)
        count = notice_streams(fleet)
        planned = plan(count, "gcp-notice", VOCAB_SIZE, output_tokens=NOTICE_OUTPUT)
        streams = Streams(fleet.coordinator_target, planned).start()
        wait_for(
            lambda: every_stream_past(streams, NOTICE_AFTER_TOKENS, count),
            120,
            "mid-stream",
        )
        noticed = busiest(fleet, streams.live)
        fleet.notice(noticed)  # instance/preempted turns TRUE
        traces = streams.join()
        result = verdict(traces, fleet.greedy_reference(planned))
        logs = fleet.logs_tail()
    assert result.problems(zero_recompute=True) == [], logs
    assert result.migrations >= 1, logs
    moved = [t for t in traces if any(e.kind == "migrated" for e in t.events)]
    assert moved and all(t.token_workers[-1] != noticed.worker_id for t in moved)
    assert all(noticed.worker_id in t.token_workers for t in moved)
