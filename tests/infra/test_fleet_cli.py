"""`spotinfer fleet ...` end to end: argparse, config, adapter, cloud endpoint, output."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from common.errors import UserError
from spotinfer.commands import fleet as fleet_command

pytest.importorskip("boto3", reason="boto3 is not installed")
pytest.importorskip("moto.server", reason="moto[server] is not installed")

from tests.infra.aws_fleet_setup import (
    REGION,
    AwsClients,
    create_fallback_group,
    create_fleet,
    group_instance_ids,
)
from tests.infra.conftest import REPO_ROOT
from tests.infra.fake_compute import FakeCompute, FakeInstance


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="spotinfer")
    fleet_command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["fleet", *argv])
    return int(args.func(args))


def aws_flags(endpoint: str) -> list[str]:
    return [
        "--cloud",
        "aws",
        "--fleet-name",
        "demo",
        "--region",
        REGION,
        "--endpoint-url",
        endpoint,
    ]


def gcp_flags(compute: FakeCompute) -> list[str]:
    return [
        "--cloud",
        "gcp",
        "--fleet-name",
        "demo",
        "--region",
        "us-central1",
        "--project",
        "spot-project",
        "--endpoint-url",
        compute.url,
    ]


def test_aws_list_scale_replace_drill(
    aws_endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    clients = AwsClients.at(aws_endpoint)
    moto_fleet = create_fleet(clients, "demo", desired=2)

    assert run(["list", *aws_flags(aws_endpoint), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {row["instance_id"] for row in listed} == group_instance_ids(
        clients, moto_fleet.group_name
    )

    assert run(["scale", *aws_flags(aws_endpoint), "--workers", "3"]) == 0
    assert "3 workers" in capsys.readouterr().out
    assert len(group_instance_ids(clients, moto_fleet.group_name)) == 3

    victim = listed[0]["instance_id"]
    assert run(["replace", *aws_flags(aws_endpoint), victim, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"replaced": [victim]}
    assert victim not in group_instance_ids(clients, moto_fleet.group_name)

    assert run(["drill", *aws_flags(aws_endpoint), "--json"]) == 0
    drill = json.loads(capsys.readouterr().out)[0]
    assert drill["cloud"] == "aws" and drill["state"] == "pending"
    assert run(["drill-status", *aws_flags(aws_endpoint), drill["drill_id"]]) == 0
    assert drill["drill_id"] in capsys.readouterr().out


def test_aws_notices_print_json_lines(
    aws_endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    clients = AwsClients.at(aws_endpoint)
    moto_fleet = create_fleet(clients, "demo", desired=1)
    (instance_id,) = group_instance_ids(clients, moto_fleet.group_name)
    event = {
        "source": "aws.ec2",
        "detail-type": "EC2 Spot Instance Interruption Warning",
        "time": "2026-11-30T12:00:00Z",
        "region": REGION,
        "detail": {"instance-id": instance_id, "instance-action": "terminate"},
    }
    clients.sqs.send_message(QueueUrl=moto_fleet.queue_url, MessageBody=json.dumps(event))

    assert run(["notices", *aws_flags(aws_endpoint), "--wait-seconds", "1"]) == 0

    (line,) = capsys.readouterr().out.splitlines()
    notice = json.loads(line)
    assert notice["instance_id"] == instance_id
    assert notice["action"] == "terminate"
    assert notice["deadline_unix"] - notice["event_time_unix"] == 120


def test_gcp_list_and_drill(fake_compute: FakeCompute, capsys: pytest.CaptureFixture[str]) -> None:
    labels = {"spotinfer-fleet": "demo", "spotinfer-role": "worker"}
    fake_compute.add(FakeInstance("demo-worker-a", "us-central1-a", labels=labels))

    assert run(["list", *gcp_flags(fake_compute)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["INSTANCE_ID", "ZONE", "STATE"]
    assert table[1].split()[:3] == ["demo-worker-a", "us-central1-a", "running"]

    assert run(["drill", *gcp_flags(fake_compute), "--wait-seconds", "1", "--json"]) == 0
    drill = json.loads(capsys.readouterr().out)[0]
    assert drill["state"] == "completed"  # the wait polled the operation to its end
    assert drill["targets"] == "demo-worker-a"
    assert fake_compute.instances["demo-worker-a"].status == "TERMINATED"


def test_aws_fallback_shows_and_sets_the_on_demand_group(
    aws_endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    clients = AwsClients.at(aws_endpoint)
    fallback_name = create_fallback_group(clients, create_fleet(clients, "demo"), max_size=3)

    assert run(["fallback", *aws_flags(aws_endpoint), "--workers", "2"]) == 0
    assert "2 fallback workers" in capsys.readouterr().out

    assert run(["fallback", *aws_flags(aws_endpoint), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [
        {"group": fallback_name, "count": "2", "max_count": "3"}
    ]
    with pytest.raises(UserError, match="maximum of 3"):
        run(["fallback", *aws_flags(aws_endpoint), "--workers", "4"])


def test_gcp_fallback_takes_its_maximum_from_the_flags(
    fake_compute: FakeCompute, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_compute.other_groups["demo-fallback"] = 0
    flags = [*gcp_flags(fake_compute), "--fallback-max-count", "2"]

    assert run(["fallback", *flags, "--workers", "2"]) == 0
    assert fake_compute.other_groups["demo-fallback"] == 2
    assert run(["fallback", *flags]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[-1].split() == ["demo-fallback", "2", "2"]

    with pytest.raises(UserError, match="--fallback-max-count"):
        run(["fallback", *gcp_flags(fake_compute), "--workers", "1"])
    with pytest.raises(UserError, match="--fallback-max-count must be a whole number"):
        run(["fallback", *gcp_flags(fake_compute), "--fallback-max-count", "two"])


def _gcp_fallback_fleet(compute: FakeCompute, spot_running: int) -> list[str]:
    """Four spot VMs wanted, ``spot_running`` of them running; an empty fallback group of 3."""
    compute.target_size = 4
    compute.other_groups["demo-fallback"] = 0
    labels = {"spotinfer-fleet": "demo", "spotinfer-role": "worker"}
    for index in range(4):
        status = "RUNNING" if index < spot_running else "TERMINATED"
        compute.add(FakeInstance(f"demo-worker-{index}", "us-central1-a", status, labels))
    return [*gcp_flags(compute), "--fallback-max-count", "3"]


def test_gcp_fallback_auto_covers_the_spot_shortfall_and_says_why(
    fake_compute: FakeCompute, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = _gcp_fallback_fleet(fake_compute, spot_running=2)

    assert run(["fallback", *flags, "--auto"]) == 0
    assert fake_compute.other_groups["demo-fallback"] == 2
    assert capsys.readouterr().out.strip() == (
        "spot 2/4 ready: fallback demo-fallback 0 → 2 (spot short by 2)"
    )

    assert run(["fallback", *flags, "--auto", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["fallback_before"], row["fallback_after"]) == ("2", "2")
    resizes = [request for request in fake_compute.requests if request.path.endswith("/resize")]
    assert len(resizes) == 1  # the second round changed nothing, so asked nothing


def test_aws_fallback_auto_releases_the_group_once_spot_is_whole(
    aws_endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    clients = AwsClients.at(aws_endpoint)
    fallback_name = create_fallback_group(clients, create_fleet(clients, "demo"), max_size=3)
    clients.autoscaling.set_desired_capacity(AutoScalingGroupName=fallback_name, DesiredCapacity=2)

    assert run(["fallback", *aws_flags(aws_endpoint), "--auto"]) == 0

    assert "2 → 0 (spot holds the load)" in capsys.readouterr().out
    assert group_instance_ids(clients, fallback_name) == set()


def _signal_self_once(signum: signal.Signals, ready: Callable[[], bool]) -> threading.Thread:
    """Send ``signum`` to this process once ``ready()`` (the command's loop is running)."""

    def watch() -> None:
        deadline = time.monotonic() + 30.0
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signum)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return watcher


def test_fallback_every_repeats_until_sigterm_and_survives_failed_rounds(
    fake_compute: FakeCompute, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = _gcp_fallback_fleet(fake_compute, spot_running=3)
    del fake_compute.other_groups["demo-fallback"]  # every round's first read fails

    def two_rounds_failed() -> bool:
        reads = [
            request for request in fake_compute.requests if request.path.endswith("/demo-fallback")
        ]
        return len(reads) >= 2

    handler_before = signal.getsignal(signal.SIGTERM)
    watcher = _signal_self_once(signal.SIGTERM, two_rounds_failed)

    assert run(["fallback", *flags, "--auto", "--every", "1"]) == 0
    watcher.join()

    captured = capsys.readouterr()
    failures = [line for line in captured.err.splitlines() if "round failed" in line]
    assert len(failures) == 2
    assert "no fallback group demo-fallback" in failures[0]
    assert captured.err.rstrip().endswith("stopped")
    assert signal.getsignal(signal.SIGTERM) is handler_before


def test_fallback_every_ends_cleanly_on_sigint(
    fake_compute: FakeCompute, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = _gcp_fallback_fleet(fake_compute, spot_running=3)

    def resized() -> bool:
        return any(request.path.endswith("/resize") for request in fake_compute.requests)

    watcher = _signal_self_once(signal.SIGINT, resized)

    # Without the signal this would wait a minute for its next round.
    assert run(["fallback", *flags, "--auto", "--every", "60"]) == 0
    watcher.join()

    (line,) = capsys.readouterr().out.splitlines()
    assert line.endswith("spot 3/4 ready: fallback demo-fallback 0 → 1 (spot short by 1)")
    assert fake_compute.other_groups["demo-fallback"] == 1


_AWS_DEMO = ["--cloud", "aws", "--fleet-name", "demo", "--region", "us-east-1"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--every", "30"], "--every repeats --auto"),
        (["--auto", "--workers", "2"], "--auto sizes the fallback group itself"),
        (["--auto", "--every", "0"], "--every must be at least 1, got 0"),
        (["--auto", "--every", "-5"], "--every must be at least 1"),
        (["--auto", "--every", "soon"], "--every must be a whole number"),
    ],
)
def test_fallback_auto_flags_that_do_not_fit_are_user_errors(
    flags: list[str], message: str
) -> None:
    with pytest.raises(UserError, match=message):
        run(["fallback", *_AWS_DEMO, *flags])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["list", "--cloud", "gcp", "--fleet-name", "demo", "--region", "us-central1"],
            "--project",
        ),
        (["list", "--cloud", "aws", "--fleet-name", "Bad!", "--region", "us-east-1"], "fleet_name"),
        (
            [
                "scale",
                "--cloud",
                "aws",
                "--fleet-name",
                "demo",
                "--region",
                "us-east-1",
                "--workers",
                "x",
            ],
            "--workers",
        ),
        (["replace", "--cloud", "aws", "--fleet-name", "demo", "--region", "us-east-1"], "--lost"),
        (
            [
                "fallback",
                "--cloud",
                "aws",
                "--fleet-name",
                "demo",
                "--region",
                "us-east-1",
                "--workers",
                "-1",
            ],
            "--workers must be at least 0",
        ),
        (
            [
                "notices",
                "--cloud",
                "gcp",
                "--fleet-name",
                "demo",
                "--region",
                "us-central1",
                "--project",
                "spot-project",
                "--endpoint-url",
                "http://127.0.0.1:9",
            ],
            "metadata server",
        ),
    ],
)
def test_bad_input_is_one_user_error(argv: list[str], message: str) -> None:
    with pytest.raises(UserError, match=message):
        run(argv)


def test_a_fleet_that_does_not_exist_is_a_user_error(aws_endpoint: str) -> None:
    with pytest.raises(UserError, match="Auto Scaling"):
        run(["scale", *aws_flags(aws_endpoint), "--workers", "2"])
    with pytest.raises(UserError, match="no on-demand fallback group"):
        run(["fallback", *aws_flags(aws_endpoint), "--workers", "1"])


def test_registering_the_command_imports_no_cloud_sdk() -> None:
    code = (
        "import argparse, sys\n"
        "from spotinfer.commands import fleet\n"
        "fleet.register(argparse.ArgumentParser().add_subparsers())\n"
        "heavy = [m for m in sys.modules if m.startswith(('boto3', 'botocore', 'google'))]\n"
        "print(heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
