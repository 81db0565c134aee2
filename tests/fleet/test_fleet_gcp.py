"""The GCP rehearsal: the startup script (metadata.google.internal, Memorystore's CA in the
URL, the TLS bundle, API keys and KV MAC keyring from Secret Manager) boots two nodes, and a
preemption on one node's metadata server moves its requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotinfer.rehearsal.streams import plan, verdict
from tests.fleet.fleet_support import (
    NOTICE_OUTPUT,
    VOCAB_SIZE,
    assert_moved_without_recompute,
    booted_fleet,
    busiest,
    notice_streams,
    on_node_at,
    wait_mid_stream,
)

pytestmark = pytest.mark.usefixtures("namespaces")


def test_a_gcp_preemption_migrates_the_nodes_requests_with_nothing_recomputed(
    tiny_model: Path, tmp_path: Path
) -> None:
    with booted_fleet(tiny_model, tmp_path, "gcp", 2) as fleet:
        assert all(vm.worker_id.startswith("spotinfer-node") for vm in fleet.nodes)
        assert all("ssl_ca_certs=" in vm.environment["SPOTINFER_REDIS_URL"] for vm in fleet.nodes)
        count = notice_streams(fleet)
        planned = plan(count, "gcp-notice", VOCAB_SIZE, output_tokens=NOTICE_OUTPUT)
        streams = fleet.streams(planned).start()
        wait_mid_stream(fleet, streams, count)
        noticed = busiest(fleet, streams.live)
        on_it = on_node_at(streams, noticed)
        fleet.notice(noticed)  # instance/preempted turns TRUE
        traces = streams.join()
        result = verdict(traces, fleet.greedy_reference(planned))
        logs = fleet.logs_tail()
        others = {vm.worker_id for vm in fleet.nodes} - {noticed.worker_id}
    assert result.problems(zero_recompute=True) == [], logs
    events = assert_moved_without_recompute(traces, noticed, on_it, others)
    assert result.migrations == len(events), logs
