"""The service kit of carlskit.cluster: one status row, one state machine, one actor host, one retry."""

from __future__ import annotations

import concurrent.futures
import gc

import pytest

from carlskit import ServiceGaveUpError, WorkerLostError
from carlskit.cluster import (
    ActorHost,
    NoWorkerError,
    Placement,
    RestartPolicy,
    ServiceState,
    ServiceStatus,
    give_up_message,
    live_workers,
    retry_on_worker_loss,
)
from carlskit.widgets import ClusterStatus


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


POLICY = RestartPolicy(budget_seconds=10.0, initial_delay_seconds=1.0, max_delay_seconds=4.0, jitter=0.0)


def test_a_status_row_reads_and_compares_like_the_dict_rows_it_replaces():
    row = ServiceStatus("restarting", 2, 7.5, "OSError: gone", "any non-accelerator worker", None,
                        {"restarts": 1})
    expected = {"state": "restarting", "failures": 2, "budget_left_seconds": 7.5, "reason": "OSError: gone",
                "placement": "any non-accelerator worker", "worker": None, "restarts": 1}
    assert row == expected and dict(row) == expected and row["restarts"] == 1 and row.get("missing") is None
    assert row.row("learner") == {"service": "learner", **expected}
    with pytest.raises(ValueError, match="state must be one of"):
        ServiceStatus("ok")


def test_service_state_restarts_with_backoff_then_gives_up_with_the_one_message(capsys):
    clock = FakeClock()
    state = ServiceState("meta-training", "the learner", POLICY, placement=Placement(), clock=clock)
    state.start()
    assert state.status()["state"] == "running" and state.status()["budget_left_seconds"] == 10.0
    assert state.failed(OSError("gone")) == 1.0 and state.state == "restarting" and not state.ready()
    clock.now = 1.0
    assert state.ready() and state.failed("again") == 2.0
    state.recovered(restarted=True)
    assert (state.state, state.restarts, state.backoff.failures) == ("running", 1, 0), "a success ends the streak"
    state.wait("the learner (restarting)")
    assert state.status()["state"] == "waiting" and state.status()["failures"] == 0, "waiting costs no budget"
    state.failed("first")
    clock.now = 12.0
    assert state.failed(WorkerLostError("lost")) is None and state.state == "gave up"
    message = give_up_message("meta-training", "the learner", 2, 10.0, "WorkerLostError: lost")
    assert state.gave_up == message and state.status()["reason"] == message
    assert "gave up the learner after 2 failures in 10 s (restart budget spent); last: WorkerLostError" in message
    with pytest.raises(ServiceGaveUpError, match="gave up the learner"):
        state.check()
    state.recovered()
    state.stop()
    assert state.state == "gave up", "giving up is final"
    assert capsys.readouterr().err.count("gave up the learner") == 1


def test_retry_on_worker_loss_retries_losses_raises_other_errors_and_gives_up():
    sleeps, retries, calls = [], [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise concurrent.futures.CancelledError() if len(calls) == 1 else NoWorkerError("none yet")
        return "done"

    result = retry_on_worker_loss(flaky, policy=POLICY, on_retry=lambda error, delay: retries.append(delay),
                                  sleep=sleeps.append)
    assert result == "done" and sleeps == retries == [1.0, 2.0]

    def broken():
        raise ValueError("a bug, not a lost worker")

    with pytest.raises(ValueError, match="a bug"):
        retry_on_worker_loss(broken, policy=POLICY, sleep=sleeps.append)

    clock = FakeClock()

    def always_lost():
        clock.now += 5.0
        raise WorkerLostError("lost again")

    import carlskit.cluster._service as service

    original = service.Backoff
    service.Backoff = lambda policy: original(policy, clock)  # the budget on a hand-advanced clock
    try:
        with pytest.raises(ServiceGaveUpError, match=r"training: gave up retrying.*last: WorkerLostError") as raised:
            retry_on_worker_loss(always_lost, policy=POLICY, what="training", sleep=lambda _: None)
    finally:
        service.Backoff = original
    assert isinstance(raised.value.__cause__, WorkerLostError)


class FakeScheduler:
    """A synchronous client's surface that live_workers uses: client.sync(client.scheduler.identity)."""

    asynchronous = False

    def __init__(self, workers):
        self.workers = workers
        self.scheduler = self

    def identity(self, n_workers=-1):
        return {"workers": {address: {"name": address[-1], "resources": {}} for address in self.workers}}

    def sync(self, function, *args, **kwargs):
        return function(*args, **kwargs)


def test_placement_choose_takes_the_least_loaded_live_worker_and_avoids_the_lost_one():
    client = FakeScheduler(["tcp://a", "tcp://b", "tcp://c"])
    load = {"tcp://a": 2, "tcp://b": 1, "tcp://c": 1}
    assert Placement().choose(client, load=load) == "tcp://b", "fewest services, ties by address"
    assert Placement().choose(client, load=load, exclude=["tcp://b"]) == "tcp://c"
    assert Placement().choose(client, index=4) == "tcp://b", "round robin without a load"
    with pytest.raises(NoWorkerError):
        Placement().choose(FakeScheduler([]))


class Counter:
    def __init__(self, start):
        self.value = start

    def add(self, amount):
        self.value += amount
        return self.value


def test_actor_host_places_rebuilds_away_from_the_old_worker_and_releases_the_old_future():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        host = ActorHost(client, Placement(), "counter")
        first = host.start(Counter, 10)
        assert first.add(1).result() == 11 and host.worker in live_workers(client)
        assert not host.lost()
        old_future, old_worker = host.future, host.worker
        assert old_future.key in client.refcount
        second = host.rebuild(Counter, 0)
        assert second.add(5).result() == 5 and host.worker != old_worker, "rebuilt on the other live worker"
        del first, old_future  # the actor handle holds a future of its own
        gc.collect()
        assert len(client.refcount) == 1, "the old actor's future was released: only the new one is held"
        host.release()
        assert host.future is None and not host.lost()


def test_cluster_status_shows_every_service_row_of_the_kit():
    state = ServiceState("writer", "the aggregator of shard 0", POLICY)
    state.start()
    state.failed("OSError: unreachable")
    report = {"services": {"aggregator 0": state.status("tcp://w", held_entries=3)}}
    board = ClusterStatus(None, sources=[lambda: report], show_devices=False)
    page = board.html.value
    assert "<td>aggregator 0</td>" in page and "<td>restarting</td>" in page and "<th>held_entries</th>" in page
    board.close()
