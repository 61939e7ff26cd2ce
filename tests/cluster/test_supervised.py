"""LongRunningTasks: relaunches failed pieces even while on_poll keeps failing; errors stay bounded."""

import time

from carlskit.cluster._supervised import MAX_KEPT_ERRORS, LongRunningTasks, stop_flag
from process_helpers import wait_until


def piece(flag, runs):
    runs.append(time.monotonic())
    if len(runs) == 1:
        raise RuntimeError("first run fails")
    while not flag.is_set():
        time.sleep(0.005)


def test_failing_on_poll_never_stops_relaunches_and_errors_stay_bounded(capsys):
    polls = []

    def broken_check():
        polls.append(1)
        raise OSError("actor check failed")

    flag, runs = stop_flag(None, "test"), []
    tasks = LongRunningTasks(None, "pieces", piece="worker", poll_seconds=0.001, on_poll=broken_check)
    tasks.launch("0", piece, lambda: (flag, runs))
    try:
        wait_until(lambda: len(runs) == 2 and tasks.error_count > MAX_KEPT_ERRORS + 10, seconds=30)
        assert tasks.running() == ["0"] and tasks.restarts == 1, "relaunched although on_poll raises every poll"
    finally:
        tasks.stop(flag, timeout=10)
    assert len(tasks.errors) == MAX_KEPT_ERRORS and tasks.error_count >= len(polls) > MAX_KEPT_ERRORS
    wheres = {where for where, _ in tasks.errors}
    assert "on_poll" in wheres
    printed = capsys.readouterr().err
    assert printed.count("actor check failed") == 1, "a repeating error is printed once, counted always"
    assert "RuntimeError: first run fails" in printed
