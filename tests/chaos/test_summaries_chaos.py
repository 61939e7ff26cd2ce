"""Chaos: a summary aggregator's worker is SIGKILLed while a writer logs 60k points.

The writer recreates the lost aggregator on the live worker and re-sends the batches it had not
acknowledged; the surviving aggregator is never touched. Every point of every name is read back
exactly once (the reader drops a batch written twice: once by the dying aggregator, once again by
its replacement). Recovery time is recorded, never asserted.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import psutil
import pytest
from process_helpers import connected_cluster

from carlskit._errors import ServiceGaveUpError
from carlskit.cluster import live_workers
from carlskit.cluster._supervised import RestartPolicy
from carlskit.summaries import SummaryReader, SummaryWriter, aggregator_of

pytestmark = pytest.mark.slow

POINTS = 60_000


@pytest.fixture
def client():
    with connected_cluster(2) as client:
        yield client


def names_on_both_shards(per_shard: int = 4) -> list[str]:
    names, counts = [], [0, 0]
    index = 0
    while min(counts) < per_shard:
        name = f"chaos/metric_{index}"
        shard = aggregator_of(name, 2)
        if counts[shard] < per_shard:
            names.append(name)
            counts[shard] += 1
        index += 1
    return names


def value_of(name_index: int, step: int) -> float:
    return name_index * 1000.0 + step * 0.25


def test_killing_one_aggregators_worker_loses_and_duplicates_no_point_on_any_shard(client, tmp_path,
                                                                                   record_property):
    names = names_on_both_shards()
    steps_per_name = POINTS // len(names)
    policy = RestartPolicy(budget_seconds=120.0, initial_delay_seconds=0.1, max_delay_seconds=2.0)
    with SummaryWriter(tmp_path, client=client, flush_every_seconds=0.05, restart_policy=policy) as writer:
        assert writer.n_shards == 2
        victim, survivor = writer._shards[0], writer._shards[1]
        survivor_actor = survivor.actor
        victim_address = victim.actor._address
        assert victim_address != survivor.actor._address  # one aggregator per worker
        pid = client.run(os.getpid, workers=[victim_address])[victim_address]

        killed_at = None
        for step in range(steps_per_name):
            for index, name in enumerate(names):
                writer.scalar(name, value_of(index, step), step)
            if step == steps_per_name // 3:
                writer.flush()  # a third acknowledged and in the victim's file
            if step == steps_per_name // 2:
                time.sleep(0.02)  # let a background flush put batches in flight
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
            if step % 500 == 0:
                time.sleep(0.01)  # a training loop's pace: several flushes during the run
        writer.flush()  # returns once every shard acknowledged every point
        flushed_after_kill = time.monotonic() - killed_at
        status = writer.status()

    victim_status, survivor_status = status["shards"]
    assert victim_status["restarts"] >= 1 and victim_status["state"] == "ok"
    assert survivor_status["restarts"] == 0 and survivor_status["recovery_seconds"] == []
    assert survivor.actor is survivor_actor  # the surviving aggregator was never replaced
    recovery = victim_status["recovery_seconds"]
    assert recovery, "the lost shard never recovered"

    reader = SummaryReader(tmp_path)
    lost = duplicated = 0
    expected_steps = np.arange(steps_per_name)
    for index, name in enumerate(names):
        frame = reader.scalars(name)
        steps = frame["step"].to_numpy()
        unique = np.unique(steps)
        duplicated += steps.size - unique.size
        lost += steps_per_name - np.intersect1d(unique, expected_steps).size
        np.testing.assert_array_equal(steps, expected_steps, err_msg=name)
        np.testing.assert_array_equal(frame["value"].to_numpy(), value_of(index, expected_steps), err_msg=name)
    assert (lost, duplicated) == (0, 0)
    # The replacement aggregator wrote a new file (its own origin) for the lost shard.
    assert len(list(tmp_path.glob("shard000-*.level0.summaries"))) >= 2
    assert len(list(tmp_path.glob("shard001-*.level0.summaries"))) == 1

    print(f"\nsummaries chaos: {len(names) * steps_per_name} points, lost {lost}, duplicated {duplicated}, "
          f"re-sent records dropped by the reader {reader.duplicate_records}, recovery "
          f"{', '.join(f'{seconds:.2f}' for seconds in recovery)} s, "
          f"flush done {flushed_after_kill:.2f} s after the kill")
    record_property("points", len(names) * steps_per_name)
    record_property("points_lost", lost)
    record_property("points_duplicated", duplicated)
    record_property("duplicate_records_dropped", reader.duplicate_records)
    record_property("recovery_seconds", recovery)
    record_property("flush_done_after_kill_seconds", round(flushed_after_kill, 3))


def test_a_writer_whose_aggregator_cannot_be_rebuilt_blocks_then_gives_up_at_the_next_call(tmp_path):
    """No worker left at all: logging blocks at ``max_pending`` (``TimeoutError`` after
    ``block_seconds``), and once the restart budget is spent the next call raises
    ``ServiceGaveUpError``; nothing is silently dropped."""
    from distributed import Client, LocalCluster
    from process_helpers import wait_for_no_children

    before = {child.pid for child in psutil.Process().children(recursive=True)}
    cluster = LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=None)
    client = Client(cluster)
    try:
        policy = RestartPolicy(budget_seconds=3.0, initial_delay_seconds=0.1, max_delay_seconds=0.5)
        writer = SummaryWriter(tmp_path, client=client, flush_every_seconds=0.05, max_pending=1_000,
                               block_seconds=0.3, restart_policy=policy)
        for step in range(10):
            writer.scalar("kept", float(step), step)
        writer.flush()
        (address,) = live_workers(client)
        cluster.scale(0)  # the only worker goes: the aggregator cannot be rebuilt anywhere
        deadline = time.monotonic() + 60
        while live_workers(client) and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(TimeoutError, match="max_pending=1000"):
            for step in range(10, 5_000):
                writer.scalar("kept", float(step), step)
        held = writer.status()["held_entries"]
        assert held == 1_000  # every accepted point is still held, none dropped
        deadline = time.monotonic() + 60
        while writer.status()["gave_up"] is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(ServiceGaveUpError, match="shard 0"):
            writer.scalar("kept", 1.0, 10_000)
        with pytest.raises(ServiceGaveUpError):
            writer.close()
        assert writer.status()["closed"]
    finally:
        client.close()
        cluster.close()
    assert SummaryReader(tmp_path).scalars("kept")["step"].tolist() == list(range(10))
    leftovers = wait_for_no_children(before)
    assert not leftovers, f"cluster left processes running: {leftovers}"
