"""Each watcher against a local server speaking its cloud's exact format."""

from __future__ import annotations

import calendar
import json
import threading
from pathlib import Path

import pytest

from context_daemon.notices import (
    AwsNoticeWatcher,
    AzureNoticeWatcher,
    FileNoticeWatcher,
    GcpNoticeWatcher,
    Notice,
    NoticeAction,
    NoticeSourceError,
    create_watcher,
    registered_watchers,
)
from context_daemon.notices.metadata_http import MetadataHttp
from spotinfer.local.metadata_servers import (
    AwsImds,
    AzureScheduledEvents,
    GcpMetadata,
    azure_preempt_event,
)

NOW_UNIX = float(calendar.timegm((2026, 11, 30, 11, 58, 0)))
WAIT_SECONDS = 10.0


class ManualClock:
    """Time that moves only when the test says so."""

    def __init__(self, now: float = NOW_UNIX) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


def test_registry_names_every_watcher() -> None:
    assert registered_watchers() == ["aws", "azure", "file", "gcp"]
    with pytest.raises(ValueError, match="unknown notice watcher"):
        create_watcher("oracle")


# --- AWS -----------------------------------------------------------------------------------


def test_aws_nothing_pending_then_termination_then_stop() -> None:
    with AwsImds() as imds:
        watcher = create_watcher("aws", base_url=imds.base_url, clock=ManualClock())
        assert isinstance(watcher, AwsNoticeWatcher)
        assert watcher.poll() is None  # 404 on both paths
        imds.instance_action = {"action": "terminate", "time": "2026-11-30T12:00:00Z"}
        notice = watcher.poll()
        assert notice is not None
        assert notice.action is NoticeAction.TERMINATE
        assert notice.deadline_unix == NOW_UNIX + 120
        assert notice.received_unix == NOW_UNIX
        assert notice.raw == imds.instance_action
        imds.instance_action = {"action": "stop", "time": "2026-11-30T12:00:00Z"}
        stopped = watcher.poll()
        assert stopped is not None and stopped.action is NoticeAction.STOP
        gets = imds.seen("GET")
        assert gets and all(r.headers.get("x-aws-ec2-metadata-token") for r in gets)
        assert len(imds.seen("PUT", "/latest/api/token")) == 1  # one token served every read


def test_aws_rebalance_recommendation_is_a_hint_without_deadline() -> None:
    with AwsImds() as imds:
        imds.rebalance = {"noticeTime": "2026-11-30T11:57:00Z"}
        watcher = AwsNoticeWatcher(base_url=imds.base_url, clock=ManualClock())
        notice = watcher.poll()
        assert notice is not None
        assert (notice.action, notice.deadline_unix) == (NoticeAction.REBALANCE, None)
        assert not notice.action.ends_vm
        imds.instance_action = {"action": "terminate", "time": "2026-11-30T12:00:00Z"}
        urgent = watcher.poll()
        assert urgent is not None and urgent.action is NoticeAction.TERMINATE


def test_aws_scale_in_lifecycle_state_is_a_notice_with_the_hooks_wait() -> None:
    clock = ManualClock()
    with AwsImds() as imds:
        watcher = AwsNoticeWatcher(base_url=imds.base_url, clock=clock, lifecycle_drain_seconds=90)
        assert watcher.poll() is None  # InService
        imds.announce_scale_in()
        notice = watcher.poll()
        assert notice is not None and notice.action is NoticeAction.TERMINATE
        assert notice.deadline_unix == NOW_UNIX + 90
        assert notice.raw == {"target-lifecycle-state": "Terminated"}
        clock.now += 5
        again = watcher.poll()
        assert again == notice, "the same termination, seen again, is one notice"
        assert again is not None and again.deadline_unix == NOW_UNIX + 90
        assert imds.seen("GET", "/latest/meta-data/autoscaling/target-lifecycle-state")
        imds.instance_action = {"action": "terminate", "time": "2026-11-30T11:59:00Z"}
        spot = watcher.poll()  # a spot notice wins: it has the cloud's own deadline
        assert spot is not None and spot.deadline_unix == NOW_UNIX + 60


def test_aws_outside_a_group_or_with_the_state_unwatched_there_is_no_lifecycle_notice() -> None:
    with AwsImds() as imds:
        imds.lifecycle_state = None  # not in an auto scaling group: 404
        assert AwsNoticeWatcher(base_url=imds.base_url, clock=ManualClock()).poll() is None
        imds.lifecycle_state = "Terminated"
        unwatched = AwsNoticeWatcher(
            base_url=imds.base_url, clock=ManualClock(), lifecycle_drain_seconds=0
        )
        assert unwatched.poll() is None
        with pytest.raises(ValueError, match="lifecycle_drain_seconds"):
            AwsNoticeWatcher(base_url=imds.base_url, lifecycle_drain_seconds=-1)


def test_aws_token_is_renewed_before_it_expires_and_after_a_401() -> None:
    clock = ManualClock()
    with AwsImds() as imds:
        watcher = AwsNoticeWatcher(base_url=imds.base_url, clock=clock, token_ttl_seconds=600)
        watcher.poll()
        puts = imds.seen("PUT")
        assert len(puts) == 1
        assert puts[0].headers["x-aws-ec2-metadata-token-ttl-seconds"] == "600"
        clock.now += 500  # still valid: no new token
        watcher.poll()
        assert len(imds.seen("PUT")) == 1
        clock.now += 60  # inside the refresh margin before expiry
        watcher.poll()
        assert len(imds.seen("PUT")) == 2
        imds.revoke_tokens()  # IMDS forgot every token: 401, then a fresh token and a retry
        imds.instance_action = {"action": "terminate", "time": "2026-11-30T12:00:00Z"}
        notice = watcher.poll()
        assert notice is not None and notice.action is NoticeAction.TERMINATE
        assert len(imds.seen("PUT")) == 3


def test_aws_without_token_support_is_an_error_not_silence() -> None:
    with AzureScheduledEvents() as not_imds:  # answers 400 to the token PUT
        watcher = AwsNoticeWatcher(base_url=not_imds.base_url, clock=ManualClock())
        with pytest.raises(NoticeSourceError):
            watcher.poll()


def test_aws_watch_loop_reports_a_notice_once() -> None:
    with AwsImds() as imds:
        watcher = AwsNoticeWatcher(
            base_url=imds.base_url, clock=ManualClock(), poll_interval_seconds=0.02
        )
        seen: list[Notice] = []
        arrived = threading.Event()

        def on_notice(notice: Notice) -> None:
            seen.append(notice)
            arrived.set()

        stop = threading.Event()
        loop = threading.Thread(target=watcher.watch, args=(on_notice, stop))
        loop.start()
        try:
            imds.instance_action = {"action": "terminate", "time": "2026-11-30T12:00:00Z"}
            assert arrived.wait(WAIT_SECONDS)
            polls_at_notice = len(imds.seen("GET", "/latest/meta-data/spot/instance-action"))
            while len(imds.seen("GET", "/latest/meta-data/spot/instance-action")) < (
                polls_at_notice + 5
            ):
                stop.wait(0.02)
        finally:
            stop.set()
            loop.join(WAIT_SECONDS)
        assert len(seen) == 1
        assert seen[0].deadline_unix == NOW_UNIX + 120


def test_watch_loop_survives_an_unreachable_metadata_service() -> None:
    with AwsImds() as imds:
        dead_url = imds.base_url
    # the server is gone: every poll fails, the loop keeps going until stopped
    watcher = AwsNoticeWatcher(base_url=dead_url, poll_interval_seconds=0.01)
    with pytest.raises(NoticeSourceError):
        watcher.poll()
    stop = threading.Event()
    loop = threading.Thread(target=watcher.watch, args=(lambda notice: None, stop))
    loop.start()
    stop.wait(0.1)
    assert loop.is_alive()
    stop.set()
    loop.join(WAIT_SECONDS)
    assert not loop.is_alive()


# --- GCP -----------------------------------------------------------------------------------


def test_gcp_false_then_true_with_deadline_from_first_sight() -> None:
    clock = ManualClock()
    with GcpMetadata() as metadata:
        watcher = GcpNoticeWatcher(base_url=metadata.base_url, clock=clock, notice_seconds=90)
        assert watcher.poll() is None  # FALSE
        metadata.set_preempted(True)
        notice = watcher.poll()
        assert notice is not None
        assert (notice.action, notice.deadline_unix) == (NoticeAction.PREEMPT, NOW_UNIX + 90)
        clock.now += 5
        again = watcher.poll()
        assert again == notice  # same notice: the deadline does not slide with each poll
        assert all(r.headers.get("metadata-flavor") == "Google" for r in metadata.seen())


def test_gcp_wait_for_change_returns_when_the_value_changes() -> None:
    with GcpMetadata() as metadata:
        watcher = GcpNoticeWatcher(
            base_url=metadata.base_url, clock=ManualClock(), wait_timeout_seconds=60
        )
        assert watcher.poll() is None  # learns the ETag of FALSE
        result: list[Notice | None] = []
        waiter = threading.Thread(target=lambda: result.append(watcher.wait_for_change()))
        waiter.start()
        while not metadata.seen("GET") or len(metadata.seen("GET")) < 2:
            threading.Event().wait(0.01)
        assert waiter.is_alive()  # the server holds the request: no answer while FALSE
        metadata.set_preempted(True)
        waiter.join(WAIT_SECONDS)
        assert result and result[0] is not None
        assert result[0].deadline_unix == NOW_UNIX + 30
        long_poll = metadata.seen("GET")[-1]
        assert long_poll.query["wait_for_change"] == "true"
        assert long_poll.query["last_etag"]


def test_gcp_wait_for_change_times_out_with_nothing_pending() -> None:
    with GcpMetadata() as metadata:
        watcher = GcpNoticeWatcher(base_url=metadata.base_url, wait_timeout_seconds=1)
        assert watcher.wait_for_change() is None
        assert metadata.seen()[-1].query["timeout_sec"] == "1"


def test_gcp_reply_without_flavor_header_is_rejected() -> None:
    with GcpMetadata(send_flavor_header=False) as impostor:
        impostor.set_preempted(True)
        watcher = GcpNoticeWatcher(base_url=impostor.base_url)
        with pytest.raises(NoticeSourceError, match="Metadata-Flavor"):
            watcher.poll()


def test_gcp_server_refuses_requests_without_flavor_header() -> None:
    with GcpMetadata() as metadata:
        reply = MetadataHttp().request(
            "GET", metadata.base_url + "/computeMetadata/v1/instance/preempted", {}, 2.0
        )
        assert reply.status == 403


def test_gcp_notice_seconds_is_bounded() -> None:
    with pytest.raises(ValueError):
        GcpNoticeWatcher(notice_seconds=121)


# --- Azure ---------------------------------------------------------------------------------


def test_azure_no_events_other_vms_and_other_types_are_nothing() -> None:
    with AzureScheduledEvents() as events:
        watcher = AzureNoticeWatcher(vm_name="spot-7", base_url=events.base_url)
        assert watcher.poll() is None
        events.events = [
            azure_preempt_event("A", ["spot-1"], "Mon, 30 Nov 2026 11:58:30 GMT"),
            {**azure_preempt_event("B", ["spot-7"], ""), "EventType": "Freeze"},
        ]
        assert watcher.poll() is None
        assert all(r.headers.get("metadata") == "true" for r in events.seen())
        assert all(r.query.get("api-version") == "2020-07-01" for r in events.seen())


def test_azure_preempt_for_this_vm_and_early_approval() -> None:
    clock = ManualClock()
    with AzureScheduledEvents() as events:
        events.events = [
            azure_preempt_event(
                "602d9444-d2cd-49c7-8624-8643e7171297",
                ["spot-1", "spot-7"],
                "Mon, 30 Nov 2026 11:58:30 GMT",
            )
        ]
        watcher = AzureNoticeWatcher(vm_name="spot-7", base_url=events.base_url, clock=clock)
        notice = watcher.poll()
        assert notice is not None
        assert notice.action is NoticeAction.PREEMPT
        assert notice.deadline_unix == NOW_UNIX + 30
        assert notice.event_id == "602d9444-d2cd-49c7-8624-8643e7171297"
        watcher.acknowledge(notice)  # what the daemon calls once the flush is complete
        (post,) = events.seen("POST")
        assert json.loads(post.body) == {
            "StartRequests": [{"EventId": "602d9444-d2cd-49c7-8624-8643e7171297"}]
        }
        assert post.headers["metadata"] == "true"
        started = watcher.poll()  # the eviction is now under way: deadline is now
        assert started is not None and started.deadline_unix == clock.now
        clock.now += 3
        assert watcher.poll() == started, "a started event is one notice, not one per poll"
        with pytest.raises(NoticeSourceError):
            watcher.approve("no-such-event")


def test_azure_server_refuses_requests_without_metadata_header() -> None:
    with AzureScheduledEvents() as events:
        reply = MetadataHttp().request(
            "GET", events.base_url + "/metadata/scheduledevents?api-version=2020-07-01", {}, 2.0
        )
        assert reply.status == 400


# --- file ----------------------------------------------------------------------------------


def test_file_notice_plain_and_with_json(tmp_path: Path) -> None:
    clock = ManualClock()
    path = tmp_path / "notice"
    watcher = create_watcher("file", path=path, grace_seconds=45, clock=clock)
    assert isinstance(watcher, FileNoticeWatcher)
    assert watcher.poll() is None
    path.write_text("")
    plain = watcher.poll()
    assert plain is not None
    assert (plain.action, plain.deadline_unix) == (NoticeAction.TERMINATE, NOW_UNIX + 45)
    clock.now += 10
    assert watcher.poll() == plain  # the deadline counts from first sight
    path.write_text(json.dumps({"action": "stop", "deadline_unix": 1_800_000_000}))
    detailed = watcher.poll()
    assert detailed is not None
    assert (detailed.action, detailed.deadline_unix) == (NoticeAction.STOP, 1_800_000_000.0)
    path.unlink()
    assert watcher.poll() is None
