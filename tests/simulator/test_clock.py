from spotinfer.simulator.clock import Clock


def test_actions_run_in_time_order_ties_in_scheduling_order() -> None:
    clock = Clock()
    seen: list[tuple[float, str]] = []
    clock.at(2.0, lambda: seen.append((clock.now, "late")))
    clock.at(1.0, lambda: seen.append((clock.now, "first")))
    clock.at(1.0, lambda: seen.append((clock.now, "second")))
    clock.run()
    assert seen == [(1.0, "first"), (1.0, "second"), (2.0, "late")]


def test_an_action_in_the_past_runs_now_and_run_stops_at_until() -> None:
    clock = Clock()
    seen: list[float] = []

    def schedule_backwards() -> None:
        clock.at(0.5, lambda: seen.append(clock.now))

    clock.at(3.0, schedule_backwards)
    clock.at(9.0, lambda: seen.append(clock.now))
    clock.run(until=5.0)
    assert seen == [3.0]
    assert clock.now == 5.0
    assert clock.pending == 1
