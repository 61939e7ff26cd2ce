"""LongRunningTasks ``hold``: pieces whose service is down wait for it instead of burning their budget."""

import threading
import time

from process_helpers import wait_until

from carlskit.cluster._supervised import LongRunningTasks, RestartPolicy, stop_flag


def test_pieces_wait_for_a_service_that_is_down_and_resume_without_spending_their_budget():
    service_up = threading.Event()
    service_up.set()
    flag, runs = stop_flag(None, "hold"), []

    def piece(flag, runs):
        runs.append(time.monotonic())
        while not flag.is_set():
            if not service_up.is_set():
                raise ConnectionError("service gone")  # what a call on a dead actor raises
            time.sleep(0.002)

    # A budget far shorter than the outage: counted failures would give the piece up.
    policy = RestartPolicy(budget_seconds=0.2, initial_delay_seconds=0.01, max_delay_seconds=0.02)
    tasks = LongRunningTasks(None, "held", piece="worker", poll_seconds=0.005, policy=policy,
                             hold=lambda: None if service_up.is_set() else "the service (down)")
    tasks.launch("0", piece, lambda: (flag, runs))
    try:
        wait_until(lambda: len(runs) == 1 and tasks.running() == ["0"])
        service_up.clear()  # an outage 5x longer than the budget
        wait_until(lambda: tasks.status()["0"]["state"] == "waiting")
        time.sleep(1.0)
        status = tasks.status()["0"]
        assert status["state"] == "waiting" and "the service (down)" in status["reason"], status
        assert len(runs) == 1 and tasks.restarts == 0, "no relaunch against a dead service"
        service_up.set()
        wait_until(lambda: len(runs) == 2 and tasks.running() == ["0"])
        assert tasks.gave_up == {} and tasks.held_endings == 1 and status["failures"] == 0
        assert tasks.status()["0"]["state"] == "running" and tasks.restarts == 1
    finally:
        tasks.stop(flag, timeout=10)
    tasks.check()  # nothing given up


def test_a_failing_hold_counts_as_no_hold_and_is_recorded():
    flag, runs = stop_flag(None, "hold-broken"), []

    def piece(flag, runs):
        runs.append(1)
        if len(runs) == 1:
            raise RuntimeError("first run fails")
        while not flag.is_set():
            time.sleep(0.002)

    def broken_hold():
        raise OSError("cannot tell")

    tasks = LongRunningTasks(None, "held", piece="worker", poll_seconds=0.005, hold=broken_hold)
    tasks.launch("0", piece, lambda: (flag, runs))
    try:
        wait_until(lambda: len(runs) == 2 and tasks.running() == ["0"])
    finally:
        tasks.stop(flag, timeout=10)
    assert any(where == "hold" for where, _ in tasks.errors) and tasks.held_endings == 0
