"""Chaos: the knowledge bank on a 2-worker LocalCluster with real SIGKILLs and damaged files.

- a lost shard is rebuilt alone by ``recover()``: the surviving shard keeps every write; the lost
  one comes back as of the latest snapshot (losing exactly its writes after it) or, with the
  write-ahead log, with every acknowledged write;
- a save killed half-way leaves the previous snapshot loadable and no part of its own;
- a flipped byte in a manifest or a part is refused naming the file.
Recovery times are recorded (``record_property``), never asserted.
"""

from __future__ import annotations

import os
import pathlib
import signal
import threading
import time

import numpy as np
import pytest
from process_helpers import checkout_cluster

from carlskit._errors import CorruptFileError, WorkerLostError
from carlskit.bank import KnowledgeBank, ShardLostError
from carlskit.bank._hashing import shard_of
from carlskit.cluster import live_workers

DIM = 8


@pytest.fixture(scope="module")
def client():
    """A 2-worker LocalCluster per test module (worker processes import this checkout)."""
    with checkout_cluster(2) as dask_client:
        yield dask_client


def two_shard_bank(client) -> KnowledgeBank:
    """A bank with one shard on each of the 2 workers (a worker killed before is back)."""
    client.wait_for_workers(2, timeout=120)
    bank = KnowledgeBank(client, num_shards=2)
    assert len(set(bank.shard_workers)) == 2
    return bank


def kill_worker_of(client, bank: KnowledgeBank, shard: int) -> str:
    """SIGKILL the worker process holding ``shard``; wait until a live bank call notices."""
    worker = bank.shard_workers[shard]
    client.wait_for_workers(2, timeout=120)  # a worker killed by an earlier test is back
    os.kill(client.run(os.getpid, workers=[worker])[worker], signal.SIGKILL)
    return worker


def wait_for_loss(bank: KnowledgeBank, keys: np.ndarray) -> ShardLostError:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            bank.row_metadata("emb", keys)
        except ShardLostError as error:
            return error
        time.sleep(0.05)
    raise AssertionError("the lost shard was never reported")


def split_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    shard = shard_of(keys, 2)
    return keys[shard == 0], keys[shard == 1]


@pytest.mark.parametrize("write_ahead_log", [False, True], ids=["snapshot-only", "with-wal"])
def test_recover_rebuilds_only_the_lost_shard(client, tmp_path, record_property, write_ahead_log):
    bank = two_shard_bank(client)
    bank.create_table("emb", dim=DIM, learning_rate=0.5, max_pending=4)
    keys = np.arange(1, 4001, dtype=np.int64)
    survivor_keys, lost_keys = split_keys(keys)
    bank.update("emb", keys, np.full((len(keys), DIM), 1.0), version=1)
    bank.enable_snapshots(tmp_path / "snapshots", write_ahead_log=write_ahead_log)
    # after the snapshot: updates, gradients (some applied by lookups), lookups that count
    bank.update("emb", keys[::2], np.full((len(keys[::2]), DIM), 2.0), version=2)
    bank.apply_gradients("emb", keys[:1000], np.ones((1000, DIM)))
    bank.lookup("emb", keys[:500])
    bank.apply_gradients("emb", keys[:200], np.full((200, DIM), 3.0))
    expected = {"values": bank.lookup("emb", keys)[0],  # flushes every cached gradient
                "meta": bank.row_metadata("emb", keys)}

    kill_worker_of(client, bank, 1)
    error = wait_for_loss(bank, keys)
    assert isinstance(error, WorkerLostError) and error.shard == 1 and error.lost_shards == [1]
    assert error.applied_shards == [0]
    np.testing.assert_array_equal(np.sort(error.applied_keys), survivor_keys)
    np.testing.assert_array_equal(np.sort(error.unapplied_keys), lost_keys)

    start = time.perf_counter()
    report = bank.recover()
    seconds = time.perf_counter() - start
    record_property("recover_seconds", seconds)
    record_property("replayed_calls", report[1]["replayed_calls"])
    print(f"\nrecover ({'with' if write_ahead_log else 'without'} WAL): {seconds:.2f} s, "
          f"{report}")
    assert list(report) == [1] and report[1]["worker"] in live_workers(client)
    assert report[1]["rows"] == {"emb": len(lost_keys)}

    meta = bank.row_metadata("emb", keys)
    values = bank.lookup("emb", keys)[0]
    on_survivor = shard_of(keys, 2) == 0
    # the surviving shard kept everything written after the snapshot
    np.testing.assert_array_equal(values[on_survivor], expected["values"][on_survivor])
    np.testing.assert_array_equal(meta["version"][on_survivor], expected["meta"]["version"][on_survivor])
    lost = ~on_survivor
    if write_ahead_log:  # nothing lost: values, versions, write times, lookup counts
        assert report[1]["replayed_calls"] == 5  # update, 2 x apply_gradients, 2 x lookup
        np.testing.assert_array_equal(values[lost], expected["values"][lost])
        for name in ("version", "last_write_time", "lookup_count"):
            np.testing.assert_array_equal(meta[name][lost], expected["meta"][name][lost])
        rows_lost = 0
    else:  # exactly the snapshot: every post-snapshot write of the lost shard is gone
        assert (values[lost] == 1.0).all() and (meta["version"][lost] == 1).all()
        assert (meta["lookup_count"][lost] == 0).all()
        rows_lost = int((expected["values"][lost] != 1.0).any(axis=1).sum())
        assert 0 < rows_lost < len(lost_keys)  # the rows whose values changed after the snapshot
    record_property("rows_lost", rows_lost)
    record_property("rows_on_lost_shard", len(lost_keys))
    # the recovered bank keeps working and snapshotting
    bank.update("emb", keys[:10], np.zeros((10, DIM)), version=3)
    assert bank.latest_snapshot() != bank.snapshot()
    bank.close()


def test_a_save_killed_half_way_leaves_the_previous_snapshot(client, tmp_path, record_property):
    bank = two_shard_bank(client)
    bank.create_table("emb", dim=64, initializer="zeros", capacity=1_200_000)
    keys = np.arange(1, 1_000_001, dtype=np.int64)
    for start in range(0, len(keys), 250_000):
        chunk = keys[start:start + 250_000]
        bank.update("emb", chunk, np.full((len(chunk), 64), 1.0), version=1)
    path = tmp_path / "snap"
    bank.save(path)
    bank.update("emb", keys[:1000], np.full((1000, 64), 2.0), version=2)
    manifest_before = (path / "manifest.json").read_bytes()
    parts_before = {p.name for p in path.iterdir()}

    outcome: dict = {}

    def save():
        try:
            bank.save(path)
        except BaseException as error:  # noqa: BLE001 - inspected below
            outcome["error"] = error

    saver = threading.Thread(target=save)
    saver.start()
    deadline = time.monotonic() + 60  # kill as soon as this save's first part file appears
    while time.monotonic() < deadline and not ({p.name for p in path.iterdir()} - parts_before):
        time.sleep(0.001)
    kill_worker_of(client, bank, 1)
    saver.join(120)
    assert isinstance(outcome.get("error"), ShardLostError), outcome
    assert (path / "manifest.json").read_bytes() == manifest_before  # the commit never happened
    assert {p.name for p in path.iterdir()} == parts_before  # the parts the failed save wrote are removed
    start = time.perf_counter()
    restored = KnowledgeBank.load(path, client)  # the previous snapshot, complete
    record_property("load_previous_seconds", time.perf_counter() - start)
    assert restored.stats()["tables"]["emb"]["rows"] == len(keys)
    values, found = restored.lookup("emb", keys[:2000])
    assert found.all() and (values == 1.0).all()
    restored.close()
    bank.close()


@pytest.mark.parametrize("target", ["manifest", "part"])
def test_damaged_snapshot_bytes_are_refused_naming_the_file(client, tmp_path, target):
    bank = two_shard_bank(client)
    bank.create_table("emb", dim=DIM)
    keys = np.arange(1, 3001, dtype=np.int64)
    bank.update("emb", keys, np.ones((len(keys), DIM)), version=1)
    bank.enable_snapshots(tmp_path / "snapshots")
    first = bank.latest_snapshot()
    second = bank.snapshot()
    victim = (pathlib.Path(second) / "manifest.json" if target == "manifest"
              else sorted(pathlib.Path(second).glob("*.part"))[-1])
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x10
    victim.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError) as caught:
        KnowledgeBank.load(second, client)
    assert caught.value.path == str(victim)
    if target == "manifest":  # readers of the series fall back to the newest intact snapshot
        assert bank.latest_snapshot() == first
    bank.close()


class Linear:
    """A 4 -> 1 linear model (built lazily: flax is imported only by this test)."""

    def __new__(cls):
        from flax import nnx

        class Model(nnx.Module):
            def __init__(self):
                self.linear = nnx.Linear(4, 1, rngs=nnx.Rngs(0))

            def __call__(self, x):
                return self.linear(x)[:, 0]

        return Model()


def mse(model, batch):
    error = model(batch["x"]) - batch["y"]
    return (error**2).mean(), {}


@pytest.mark.parametrize("snapshots", [True, False], ids=["recovers", "stops-resumable"])
def test_fit_survives_a_lost_bank_shard(client, tmp_path, record_property, snapshots):
    """Trainer.fit with a bank knowledge stage while a shard's worker is SIGKILLed: with snapshots
    the shard is rebuilt and every step runs; without, fit stops naming the shard and the last
    finished step is a published checkpoint."""
    import optax

    from carlskit.training import CheckpointStore, NeighborKnowledge, Trainer

    bank = two_shard_bank(client)
    bank.create_table("emb", dim=2)
    bank.create_feature_table("nbrs", {"ids": ("int64", 2), "weights": ("float32", 2)})
    items = np.arange(1, 201, dtype=np.int64)
    bank.update("nbrs", items, {"ids": np.stack([items % 200 + 1, (items + 1) % 200 + 1], 1),
                                "weights": np.ones((200, 2))}, version=0)
    bank.update("emb", items, np.ones((200, 2)), version=0)
    if snapshots:
        bank.enable_snapshots(tmp_path / "bank", write_ahead_log=True)
    store = CheckpointStore(tmp_path / "ckpt")
    trainer = Trainer(Linear(), optax.sgd(0.01), mse, checkpoints=store, checkpoint_every=10,
                      knowledge=NeighborKnowledge(bank, max_neighbors=2), prefetch=1)
    killed = threading.Event()

    def data(step):
        if step == 15 and not killed.is_set():
            kill_worker_of(client, bank, 1)
            killed.set()
            time.sleep(1.0)  # the bank's next call meets the dead worker
        rng = np.random.default_rng(step)
        x = rng.normal(size=(16, 4)).astype(np.float32)
        return {"x": x, "y": x.sum(1), "ids": rng.choice(items, 16)}

    steps = 40
    if snapshots:
        history = trainer.fit(data, steps, progress=False, live=False)
        assert len(history) == steps and trainer.step == steps
        assert [r["shards"] for r in trainer.bank_recoveries] == [[1]]
        record_property("fit_recovery_seconds", trainer.bank_recoveries[0]["seconds"])
        print(f"\nfit recovered shard 1 in {trainer.bank_recoveries[0]['seconds']:.2f} s")
    else:
        with pytest.raises(ShardLostError, match="lost bank shard 1 .* no snapshots") as caught:
            trainer.fit(data, steps, progress=False, live=False)
        assert caught.value.shard == 1
        assert 10 <= trainer.step < steps and store.latest() == trainer.step  # resumable here
    bank.close()
