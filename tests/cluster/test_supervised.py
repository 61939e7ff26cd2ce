"""LongRunningTasks: relaunches failed pieces even while on_poll keeps failing; errors stay bounded."""

import time

from process_helpers import wait_until

from carlskit.cluster._supervised import MAX_KEPT_ERRORS, LongRunningTasks, stop_flag


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


# -- restart policy: backoff with jitter, budget in seconds ------------------------------------------
import random  # noqa: E402

import pytest  # noqa: E402

from carlskit._errors import ServiceGaveUpError  # noqa: E402
from carlskit.cluster._loss import is_worker_loss  # noqa: E402
from carlskit.cluster._supervised import Backoff, RestartPolicy, restart_policy  # noqa: E402


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_backoff_delays_grow_exponentially_with_jitter_and_stop_at_the_cap():
    policy = RestartPolicy(initial_delay_seconds=1.0, max_delay_seconds=8.0, multiplier=2.0, jitter=0.5)
    rng = random.Random(0)
    for failures, base in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 8.0), (1000, 8.0)]:
        delays = [policy.delay(failures, rng) for _ in range(200)]
        assert all(0.5 * base <= d <= base for d in delays), (failures, min(delays), max(delays))
        assert max(delays) - min(delays) > 0.3 * base, "jitter spreads retries"
    assert RestartPolicy(jitter=0.0, initial_delay_seconds=1.0).delay(3, rng) == 4.0


def test_budget_is_time_not_a_count_and_a_healthy_run_starts_a_new_budget():
    clock = FakeClock()
    backoff = Backoff(RestartPolicy(budget_seconds=60.0, initial_delay_seconds=0.1, max_delay_seconds=5.0), clock)
    fast_failures = [backoff.failure() for _ in range(500)]  # a fast crash loop inside one second
    assert all(delay is not None for delay in fast_failures), "500 quick failures do not spend a 60 s budget"
    assert backoff.seconds_left() == 60.0
    clock.now = 59.0
    assert backoff.failure() is not None and not backoff.ready()
    clock.now = 60.5
    assert backoff.failure() is None, "given up once 60 s have passed since the streak began"
    backoff.success()
    assert backoff.failures == 0 and backoff.failure() is not None and backoff.seconds_left() == 60.0


@pytest.mark.parametrize("kwargs, error, match", [
    ({"budget_seconds": 0}, ValueError, "budget_seconds"),
    ({"budget_seconds": "10"}, TypeError, "budget_seconds"),
    ({"multiplier": 0.5}, ValueError, "multiplier"),
    ({"jitter": 1.0}, ValueError, "jitter"),
    ({"initial_delay_seconds": 5.0, "max_delay_seconds": 1.0}, ValueError, "max_delay_seconds"),
])
def test_restart_policy_rejects_bad_settings_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        RestartPolicy(**kwargs)


def test_restart_policy_accepts_a_budget_in_seconds():
    assert restart_policy(None) == RestartPolicy()
    assert restart_policy(12.5).budget_seconds == 12.5
    with pytest.raises(TypeError, match="restart_policy"):
        restart_policy(True)


def always_fails(runs):
    runs.append(time.monotonic())
    raise OSError("boom")


def test_a_piece_that_keeps_failing_is_given_up_visibly_and_check_raises():
    flag, runs, given_up = stop_flag(None, "t"), [], []
    policy = RestartPolicy(budget_seconds=0.6, initial_delay_seconds=0.05, max_delay_seconds=0.1)
    tasks = LongRunningTasks(None, "fails", piece="worker", poll_seconds=0.01, policy=policy,
                             on_give_up=lambda key, reason: given_up.append((key, reason)))
    tasks.launch("0", always_fails, lambda: (runs,))
    try:
        wait_until(lambda: tasks.gave_up, seconds=30)
    finally:
        tasks.stop(flag, timeout=5)
    gaps = [b - a for a, b in zip(runs, runs[1:])]
    assert len(runs) >= 3 and min(gaps) >= 0.02, "relaunches waited for their backoff"
    assert len(runs) < 40, "no crash loop: backoff spaces the relaunches"
    assert given_up and given_up[0][0] == "0" and "OSError: boom" in given_up[0][1]
    assert tasks.status()["0"]["state"] == "gave up"
    with pytest.raises(ServiceGaveUpError, match="gave up worker 0 .*OSError: boom"):
        tasks.check()


def returns_at_once():
    return 7


def test_a_piece_that_ends_unasked_counts_as_a_failure_with_a_reason():
    flag = stop_flag(None, "t")
    tasks = LongRunningTasks(None, "ends", poll_seconds=0.01,
                             policy=RestartPolicy(budget_seconds=30, initial_delay_seconds=5.0, max_delay_seconds=5.0))
    tasks.launch("a", returns_at_once, lambda: ())
    try:
        wait_until(lambda: tasks.status()["a"]["state"] == "restarting", seconds=10)
        assert "returned 7 without being stopped" in tasks.status()["a"]["reason"]
    finally:
        tasks.stop(flag, timeout=5)


def test_worker_loss_is_recognised_by_type_including_a_cause_chain():
    from concurrent.futures import CancelledError

    from distributed import KilledWorker
    from distributed.comm.core import CommClosedError

    from carlskit._errors import WorkerLostError

    assert is_worker_loss(CommClosedError("x")) and is_worker_loss(KilledWorker("k", "w", 3))
    assert is_worker_loss(CancelledError()) and is_worker_loss(WorkerLostError("shard 1"))
    try:
        try:
            raise CommClosedError("closed")
        except CommClosedError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert is_worker_loss(outer)
    assert not is_worker_loss(RuntimeError("Worker holding Actor was lost")), "never by message text"
    assert not is_worker_loss(ValueError("bad")) and not is_worker_loss(None)


def sums_its_data(flag, data):
    while not flag.is_set():
        time.sleep(0.01)
    return float(data.sum())


def test_a_piece_whose_data_travels_in_its_task_raises_no_large_graph_warning():
    # A maker's features ride inside the slice's task on purpose (recomputable after a lost worker):
    # Dask's "Sending large graph" warning (10 MB by default) would fire on every start in a notebook.
    import warnings

    import numpy as np
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        flag = stop_flag(client, "large-data")
        tasks = LongRunningTasks(client, "large", poll_seconds=0.01)
        data = np.ones(4_000_000, np.float32)  # 16 MB
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any warning fails the test, Dask's among them
            tasks.launch("a", sums_its_data, lambda: (flag, data))
        try:
            wait_until(lambda: tasks.status()["a"]["state"] == "running", seconds=30)
        finally:
            tasks.stop(flag, timeout=30)
    with pytest.warns(UserWarning, match="Sending large graph"):  # the same submit without the setting warns
        with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
            client.submit(sums_its_data, None, data, pure=False).cancel()
