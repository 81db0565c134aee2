"""The registry's clock leaves out the coordinator's own stalls: workers whose answers
waited unread while the coordinator was starved are not LOST for it, while a worker that
is really silent still is, once the coordinator has listened that long."""

from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.attentive_clock import STALL_TOLERANCE_SECONDS, TICK_SECONDS, AttentiveClock
from coordinator.heartbeat import Heartbeat
from coordinator.registry import Registry, WorkerState
from tests.support.clock import ManualClock
from tests.support.factories import (
    LEASE_TTL_SECONDS,
    LOST_AFTER_SECONDS,
    Fakes,
    make_registration,
)
from tests.support.fake_worker import FakeWorker


def _ticking(monotonic: ManualClock) -> AttentiveClock:
    clock = AttentiveClock(monotonic)
    clock.tick()  # as start() does: from now on the ticker is running
    return clock


def _listen(clock: AttentiveClock, monotonic: ManualClock, seconds: float) -> None:
    """The loop runs: the ticker wakes on time for `seconds`."""
    for _ in range(round(seconds / TICK_SECONDS)):
        monotonic.advance(TICK_SECONDS)
        clock.tick()


def test_without_a_ticker_it_is_the_plain_clock() -> None:
    monotonic = ManualClock()
    clock = AttentiveClock(monotonic)
    monotonic.advance(30.0)
    assert clock() == monotonic() and clock.stalled_seconds == 0


def test_a_late_wake_is_left_out_and_on_time_ones_are_not() -> None:
    monotonic = ManualClock()
    clock = _ticking(monotonic)
    start = clock()
    _listen(clock, monotonic, 2.0)
    assert clock() - start == pytest.approx(2.0)
    monotonic.advance(TICK_SECONDS + STALL_TOLERANCE_SECONDS * 0.9)  # scheduling noise
    clock.tick()
    assert clock.stalled_seconds == 0
    monotonic.advance(8.0)  # stalled
    clock.tick()
    assert clock.stalled_seconds == pytest.approx(8.0 - TICK_SECONDS)
    expected = 2.0 + TICK_SECONDS + STALL_TOLERANCE_SECONDS * 0.9 + TICK_SECONDS
    assert clock() - start == pytest.approx(expected)


def test_a_reading_before_the_ticker_catches_up_counts_the_stall_once() -> None:
    monotonic = ManualClock()
    clock = _ticking(monotonic)
    before = clock()
    monotonic.advance(8.0)
    after = clock()  # e.g. a state refresh is the first callback after the stall
    clock.tick()  # then the ticker
    assert after - before == pytest.approx(TICK_SECONDS) and clock() == pytest.approx(after)
    assert clock.stalled_seconds == pytest.approx(8.0 - TICK_SECONDS)


def _registry(clock: AttentiveClock) -> tuple[Registry, FakeWorker]:
    registry = Registry(LOST_AFTER_SECONDS, Fakes().client, clock)
    entry, _ = registry.register(make_registration("10.0.0.5:50061"))
    assert isinstance(entry.client, FakeWorker)
    entry.client.capacity = entry.capacity
    return registry, entry.client


async def test_workers_answering_during_a_coordinator_stall_are_not_lost() -> None:
    monotonic = ManualClock()
    clock = _ticking(monotonic)
    registry, _ = _registry(clock)
    heartbeat = Heartbeat(registry, interval_seconds=1.0)
    # Longer than both the silence limit and the lease: the worker renewed and answered,
    # but the coordinator read nothing until it woke.
    monotonic.advance(max(LOST_AFTER_SECONDS, LEASE_TTL_SECONDS) + 5.0)
    registry.refresh()
    assert [e.state for e in registry] == [WorkerState.READY]
    await heartbeat.beat()
    assert [e.state for e in registry] == [WorkerState.READY]


async def test_a_silent_worker_is_lost_once_the_coordinator_has_listened_long_enough() -> None:
    monotonic = ManualClock()
    clock = _ticking(monotonic)
    registry, worker = _registry(clock)
    heartbeat = Heartbeat(registry, interval_seconds=1.0)
    worker.down = True
    monotonic.advance(20.0)  # a stall first: not counted
    await heartbeat.beat()
    assert [e.state for e in registry] == [WorkerState.READY]
    _listen(clock, monotonic, LOST_AFTER_SECONDS + 1.0)  # then real listening, and silence
    await heartbeat.beat()
    assert [e.state for e in registry] == [WorkerState.LOST]


async def test_the_ticker_runs_on_the_loop_and_a_blocked_loop_is_left_out() -> None:
    clock = AttentiveClock()
    clock.start()
    await asyncio.sleep(TICK_SECONDS * 2)
    time.sleep(TICK_SECONDS + STALL_TOLERANCE_SECONDS + 0.5)  # the loop blocked
    await asyncio.sleep(TICK_SECONDS * 2)
    await clock.stop()
    assert clock.stalled_seconds >= 0.5
    left_out = clock.stalled_seconds
    time.sleep(TICK_SECONDS + STALL_TOLERANCE_SECONDS + 0.1)  # stopped: nothing left out
    clock()
    assert clock.stalled_seconds == left_out
