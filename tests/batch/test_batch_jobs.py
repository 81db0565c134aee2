"""Acceptance: a Batch API job of 200 lines on a local cluster (TLS, API keys, Redis with TLS
and per-role ACL users) runs through a spot notice and a coordinator restart. Every line
gets exactly one result, each equal to the same line run alone (greedy); the lines moved
on the notice recomputed nothing and none was started again because of it; the lines that
had their result before the restart were never run again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from spotinfer.local.cluster import ClusterConfig, LocalCluster
from store import keys
from store.keys import KeyKind

LINES = 200
# Lines of one length start together and end at the same step, so the first result would
# come with a whole wave's: a notice then can find the noticed node between waves, with
# nothing to move (CI saw it). Lengths spread over 120..199 tokens: at the first result the
# rest of the first wave is still decoding there, 0..79 tokens to go.
MAX_TOKENS_LOW = 120
MAX_TOKENS_SPREAD = 80
# Lines in flight at once: the job runs in waves, so that on a fast machine it is still
# running well after the results the restart waits for (at the default 64 a machine with
# AVX-512 or a quick AVX2 core ran all 200 lines 8 s after the notice, past the restart).
LINES_IN_FLIGHT = 16
NOTICE_AFTER_RESULTS = 1
RESTART_AFTER_RESULTS = 110
WAIT_SECONDS = 600.0
MOVE_WAIT_SECONDS = 300.0
GRACE_SECONDS = 8.0  # under the staging threshold: the flush moves the lines at once


@pytest.fixture
def cluster(tiny_model: Path, tmp_path: Path) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        model=str(tiny_model),
        workers=1,
        standbys=1,
        dtype="float32",
        max_model_len=1024,
        memory_gib=0.25,
        log_dir=tmp_path / "logs",
        coordinator_flags=(
            *("--record-retention-seconds", "1"),
            *("--batch-lines-in-flight", str(LINES_IN_FLIGHT)),
        ),
    )
    with LocalCluster(config) as started:
        yield started


class Front:
    """The coordinator's HTTP front as an OpenAI client would use it (TLS, a tenant key)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self._cluster = cluster
        self.session = requests.Session()
        # Per request: a session's own `verify` loses to REQUESTS_CA_BUNDLE (requests #3829).
        self._ca_file = cluster.client_transport.ca_file
        self.session.headers["Authorization"] = f"Bearer {cluster.api_key}"

    def url(self, path: str) -> str:
        return self._cluster.coordinator.http_url + path

    def call(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        response = self.session.request(
            method, self.url(path), timeout=120, verify=self._ca_file, **kwargs
        )
        assert response.status_code == 200, f"{method} {path}: {response.text}"
        return response

    def batch(self, batch_id: str) -> dict[str, Any]:
        """The batch object; waits out the moments the coordinator is restarting."""
        deadline = time.monotonic() + 60
        while True:
            try:
                return dict(self.call("GET", f"/v1/batches/{batch_id}").json())
            except requests.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def wait(self, batch_id: str, done: int) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            job = self.batch(batch_id)
            counts = job["request_counts"]
            if counts["completed"] + counts["failed"] >= done or job["status"] in (
                "completed",
                "failed",
                "cancelled",
                "expired",
            ):
                return job
            assert time.monotonic() < deadline, f"batch stuck at {counts} ({job['status']})"
            time.sleep(0.2)


def _lines() -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"line-{i:03d}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "prompt": f"Entry {i}: the harbour log for day {i * 7 % 31} reads",
                "max_tokens": MAX_TOKENS_LOW + i * 37 % MAX_TOKENS_SPREAD,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for i in range(LINES)
    ]


def _store_view(cluster: LocalCluster, batch_id: str) -> tuple[dict[str, str], dict[str, str]]:
    """The job's results and attempts as Redis holds them (the operator's user)."""
    client = redis.Redis.from_url(cluster.redis_url, **cluster.redis_admin_options)
    try:
        results = client.hgetall(keys.batch_object_key(KeyKind.BATCH_RESULTS, batch_id))
        attempts = client.hgetall(keys.batch_object_key(KeyKind.BATCH_LINES, batch_id))
    finally:
        client.close()
    decode = lambda fields: {k.decode(): v.decode() for k, v in fields.items()}  # noqa: E731
    return decode(results), decode(attempts)


def _notice(cluster: LocalCluster) -> str:
    """The cloud's termination notice for the active node, through its metadata server (as
    the drills give it): the node's daemon sees it and the coordinator moves its requests."""
    name = cluster.active_nodes()[0].name
    cluster.preempt(name, GRACE_SECONDS)
    return name


def _wait_for_a_moved_line(front: Front, batch_id: str, cluster: LocalCluster) -> None:
    """Until a line the notice moved has its result (on a slow machine the move can take
    longer than the results the restart waits for)."""
    deadline = time.monotonic() + MOVE_WAIT_SECONDS
    while True:
        job = front.batch(batch_id)
        if job["spotinfer"]["migrated_lines"] > 0:
            return
        done = job["request_counts"]["completed"] + job["request_counts"]["failed"]
        assert time.monotonic() < deadline and done < LINES, (
            f"the notice moved no line: {job['spotinfer']}, {done} results\n" + cluster.logs_tail()
        )
        time.sleep(0.2)


def test_a_batch_job_survives_a_notice_and_a_coordinator_restart(cluster: LocalCluster) -> None:
    front = Front(cluster)
    lines = _lines()
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = front.call(
        "POST", "/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}
    ).json()
    assert uploaded["bytes"] == len(content) and uploaded["purpose"] == "batch"
    job = front.call(
        "POST",
        "/v1/batches",
        json={
            "input_file_id": uploaded["id"],
            "endpoint": "/v1/completions",
            "completion_window": "24h",
        },
    ).json()
    batch_id = job["id"]

    front.wait(batch_id, NOTICE_AFTER_RESULTS)
    noticed = _notice(cluster)
    _wait_for_a_moved_line(front, batch_id, cluster)
    job = front.wait(batch_id, RESTART_AFTER_RESULTS)
    assert job["status"] == "in_progress", "the job must still be running at the restart"
    moved = job["spotinfer"]
    assert moved["migrated_lines"] > 0, f"the notice moved no line: {moved}"
    assert moved["recomputed_tokens"] == 0 and moved["restarted_lines"] == 0, moved
    cluster.terminate(noticed)  # the VM goes, its requests long moved

    written_before, attempts_before = _store_view(cluster, batch_id)
    cluster.restart_coordinator()
    job = front.wait(batch_id, LINES)
    deadline = time.monotonic() + WAIT_SECONDS
    while job["status"] != "completed":
        assert job["status"] in ("in_progress", "finalizing"), job
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
        job = front.batch(batch_id)

    assert job["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    assert job["error_file_id"] is None and job["spotinfer"]["refused_writes"] == 0
    output = front.call("GET", f"/v1/files/{job['output_file_id']}/content").text
    results = [json.loads(row) for row in output.splitlines()]
    assert [r["custom_id"] for r in results] == [line["custom_id"] for line in lines]
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in results)

    # Nothing finished before the restart ran again: the same result, the same request.
    written_after, attempts_after = _store_view(cluster, batch_id)
    assert len(written_before) >= RESTART_AFTER_RESULTS
    for custom_id, result in written_before.items():
        assert written_after[custom_id] == result
        assert attempts_after[custom_id] == attempts_before[custom_id], custom_id

    def alone(line: dict[str, Any]) -> str:
        answer = front.call("POST", "/v1/completions", json=line["body"]).json()
        return str(answer["choices"][0]["text"])

    with ThreadPoolExecutor(4) as pool:
        references = list(pool.map(alone, lines))
    texts = [r["response"]["body"]["choices"][0]["text"] for r in results]
    mismatched = [i for i in range(LINES) if texts[i] != references[i]]
    shown = [(lines[i]["custom_id"], texts[i], references[i]) for i in mismatched[:3]]
    assert not mismatched, f"{len(mismatched)} differ from the line run alone: {shown}"
    print(f"batch {batch_id}: {job['spotinfer']}")

    # The CLI reads the same job back.
    from spotinfer.cli import main

    access = ["--url", front.url(""), "--ca-file", cluster.client_transport.ca_file]
    access += ["--api-key", cluster.api_key]
    out = cluster.config.log_dir / "results.jsonl"
    assert main(["batch", "status", batch_id, *access]) == 0
    assert main(["batch", "results", batch_id, "--out", str(out), *access]) == 0
    assert out.read_text() == output
