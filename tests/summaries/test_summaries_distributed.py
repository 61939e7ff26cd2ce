"""SummaryWriter through sharded aggregator actors on a LocalCluster, including from Dask tasks."""

from __future__ import annotations

import time

import pytest
from process_helpers import connected_cluster

from carlskit.summaries import SummaryReader, SummaryWriter, aggregator_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    with connected_cluster(2) as client:
        yield client


def log_from_task(writer: SummaryWriter, task: int, points: int) -> int:
    """Runs on a Dask worker: the unpickled writer logs through the same aggregators. The task
    runs longer than the flush period, so the copy's background thread flushes from the worker."""
    with writer:
        for step in range(points):
            writer.scalar(f"task{task}/loss", task + step / points, step)
            if step % 500 == 0:
                time.sleep(0.05)
        writer.text(f"task{task}/where", "worker", 0)
    return points


def test_aggregators_shard_by_name_and_everything_is_read_back(client, tmp_path):
    names = [f"metric/{index}" for index in range(12)]
    with SummaryWriter(tmp_path, client=client, flush_every_seconds=0.1) as writer:
        assert writer.n_shards == 2
        for step in range(2_000):
            for name in names:
                writer.scalar(name, step * 0.5, step)
        writer.flush()
        reader = SummaryReader(tmp_path)
        assert reader.names() == sorted(names)  # readable before the writer closes
    used_shards = sorted({aggregator_of(name, 2) for name in names})
    origins = sorted(path.name.split("-")[0] for path in tmp_path.glob("*.level0.summaries"))
    assert origins == [f"shard{shard:03d}" for shard in used_shards]
    for name in names:
        frame = reader.scalars(name)
        assert frame["step"].tolist() == list(range(2_000))
        assert frame["value"].tolist() == [step * 0.5 for step in range(2_000)]
    # every name lives on exactly one shard's files
    for path in tmp_path.glob("*.level0.summaries"):
        shard = int(path.name[len("shard"):len("shard") + 3])
        data = path.read_bytes()
        for name in names:
            assert (name.encode() in data) == (aggregator_of(name, 2) == shard)


def test_writes_from_code_running_on_dask_workers(client, tmp_path):
    points = 3_000
    with SummaryWriter(tmp_path, client=client, flush_every_seconds=0.02) as writer:
        writer.scalar("driver/loss", 1.0, 0)
        futures = client.map(log_from_task, [writer] * 4, range(4), [points] * 4, pure=False)
        assert client.gather(futures) == [points] * 4
    reader = SummaryReader(tmp_path)
    assert set(reader.names()) == {"driver/loss"} | {f"task{t}/loss" for t in range(4)} | {
        f"task{t}/where" for t in range(4)}
    for task in range(4):
        frame = reader.scalars(f"task{task}/loss")
        assert frame["step"].tolist() == list(range(points))
        assert frame["value"].tolist() == [task + step / points for step in range(points)]
    assert all(path.name.startswith("shard") for path in tmp_path.glob("*.summaries"))


def test_sampled_distributed_writer(client, tmp_path):
    with SummaryWriter(tmp_path, client=client, sample_rate=0.1, seed=3) as writer:
        kept = sum(writer.scalar("x", 1.0, step) for step in range(10_000))
    assert abs(kept - 1_000) < 5 * (10_000 * 0.1 * 0.9) ** 0.5
    assert SummaryReader(tmp_path).count("x") == kept
