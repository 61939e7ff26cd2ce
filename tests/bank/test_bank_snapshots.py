"""Snapshot series, automatic snapshots and the write-ahead log, in-process (the distributed
recovery of a lost shard is in tests/chaos/test_bank_chaos.py)."""

import os
import pathlib
import time

import numpy as np
import pytest
from process_helpers import wait_until

from carlskit._errors import CorruptFileError
from carlskit.bank import KnowledgeBank
from carlskit.bank._shard import _Shard
from carlskit.bank._snapshot import Location, import_plan, read_manifest
from carlskit.bank._wal import records_since, segment_numbers, shard_directory

DIM = 4


def rebuilt_shard(bank: KnowledgeBank, shard: int, clock) -> _Shard:
    """Shard ``shard`` rebuilt the way recover() rebuilds a lost one: a new shard, the tables,
    its part of the latest snapshot, then its write-ahead log since that snapshot."""
    path = bank.latest_snapshot()
    manifest = read_manifest(Location(path))
    fresh = _Shard(shard, bank.num_shards, clock)
    for name, config in bank._all_configs().items():
        fresh.create_table(name, config)
    fresh.import_snapshot(path, import_plan(manifest, shard, bank.num_shards))
    fresh.replay_write_ahead_log(bank._snapshots.wal_directory, manifest["write_ahead_log"][shard])
    return fresh


def shard_state(shard: _Shard) -> dict:
    out = {}
    for name, table in shard._tables.items():
        columns, meta = table.snapshot_columns()
        for column, array in columns:
            if not column.startswith("row_map_"):
                out[name, column] = array.copy()
        # counters of calls that only read (nearest, sample) are not logged: not rebuilt
        out[name, "counters"] = {key: value for key, value in table.counters.items()
                                 if key not in ("nearest_shard_calls", "sample_shard_calls")}
    return out


def test_a_shard_rebuilt_from_snapshot_and_write_ahead_log_equals_the_live_one(tmp_path, clock):
    bank = KnowledgeBank(num_shards=2, clock=clock)
    bank.create_table("emb", dim=DIM, optimizer="adagrad", max_pending=3, pending_ttl_seconds=5)
    bank.create_feature_table("nbrs", {"ids": ("int64", 2)})
    keys = np.arange(1, 400)
    bank.lookup("emb", keys, insert_missing=True)
    bank.enable_snapshots(tmp_path / "snaps", write_ahead_log=True)
    rng = np.random.default_rng(0)
    for step in range(12):  # every kind of change, ttl flushes noticed by reads included
        clock.now += 2
        batch = rng.choice(keys, 64)
        bank.apply_gradients("emb", batch, rng.normal(size=(64, DIM)))
        if step % 3 == 0:
            bank.lookup("emb", rng.choice(keys, 16))
        if step % 4 == 1:
            bank.update("emb", batch[:8], rng.normal(size=(8, DIM)), version=step)
            bank.update("nbrs", batch[:4], {"ids": np.full((4, 2), step)}, version=step)
        if step % 5 == 2:
            bank.nearest("emb", rng.normal(size=(2, DIM)), k=3)  # a read whose ttl flush is logged
        if step == 6:
            bank.snapshot()  # the log starts again here
    bank.lookup("emb", np.arange(1000, 1010), insert_missing=True)
    bank.flush("emb")
    bank.apply_gradients("emb", keys[:5], np.ones((5, DIM)))
    for shard in range(2):
        live = shard_state(bank._shards[shard])
        rebuilt = shard_state(rebuilt_shard(bank, shard, clock))
        assert live.keys() == rebuilt.keys()
        for key in live:
            if isinstance(live[key], np.ndarray):
                np.testing.assert_array_equal(live[key], rebuilt[key], err_msg=str(key))
            else:
                assert live[key] == rebuilt[key], key


@pytest.mark.parametrize("kept_by", ["write-ahead log", "snapshot"])
def test_a_push_re_sent_with_its_id_to_a_rebuilt_shard_counts_once(tmp_path, clock, kept_by):
    """What ``BankEmbeddings`` does after a lost shard (tests/chaos/test_bank_embedding_chaos.py):
    the push was applied and logged (or is in the snapshot) but its acknowledgement was lost; the
    shard is rebuilt and the push re-sent with its id, and counts once. The same re-send without
    an id (the baseline) counts twice."""
    bank = KnowledgeBank(num_shards=1, clock=clock)
    bank.create_table("emb", dim=DIM, initializer="zeros", optimizer="sgd", learning_rate=1.0,
                      max_pending=1)
    keys, ones = np.arange(1, 9), np.ones((8, DIM))
    bank.enable_snapshots(tmp_path / "snaps", write_ahead_log=True)
    bank.apply_gradients("emb", keys, ones, push_id=7)
    bank.apply_gradients("emb", keys, 2 * ones)  # no id
    if kept_by == "snapshot":
        bank.snapshot()
    rebuilt = rebuilt_shard(bank, 0, clock)
    rebuilt.apply_gradients("emb", keys, ones, 7)  # the re-send: applied already
    rows, _ = rebuilt.lookup("emb", keys, False)
    np.testing.assert_array_equal(rows, np.full((8, DIM), -3.0))
    assert rebuilt._tables["emb"].counters["repeated_pushes_skipped"] == 1
    rebuilt.apply_gradients("emb", keys, 2 * ones, None)  # the baseline: a re-send without an id
    rows, _ = rebuilt.lookup("emb", keys, False)
    np.testing.assert_array_equal(rows, np.full((8, DIM), -5.0))
    bank.apply_gradients("emb", keys, ones, push_id=8)  # a new id is applied
    rows, _ = bank.lookup("emb", keys)
    np.testing.assert_array_equal(rows, np.full((8, DIM), -4.0))


def test_push_ids_are_checked_before_anything_is_sent(clock):
    bank = KnowledgeBank(num_shards=2, clock=clock)
    bank.create_table("emb", dim=DIM, initializer="zeros")
    for bad, error in [("7", TypeError), (True, TypeError), (1.0, TypeError), (-1, ValueError),
                       (2 ** 63, ValueError)]:
        with pytest.raises(error, match="push_id"):
            bank.apply_gradients("emb", [1, 2], np.ones((2, DIM)), push_id=bad)
        with pytest.raises(error, match="push_id"):
            bank.apply_gradients_async("emb", [1, 2], np.ones((2, DIM)), push_id=bad)
    assert bank.stats()["tables"]["emb"]["gradients_received"] == 0


def test_write_ahead_log_is_truncated_at_each_snapshot_and_checksummed(tmp_path):
    bank = KnowledgeBank(num_shards=1)
    bank.create_table("emb", dim=DIM)
    bank.enable_snapshots(tmp_path / "snaps", write_ahead_log=True, keep=2)
    wal = bank._snapshots.wal_directory
    bank.update("emb", [1, 2], np.ones((2, DIM)))
    bank.snapshot()
    bank.update("emb", [3], np.ones((1, DIM)))
    bank.snapshot()
    assert segment_numbers(shard_directory(wal, 0)) == [2]  # older segments deleted
    assert len([p for p in os.listdir(tmp_path / "snaps") if p.startswith("snapshot-")]) == 2
    for _ in range(3):
        bank.update("emb", [4], np.ones((1, DIM)))
    segment = pathlib.Path(shard_directory(wal, 0)) / "000000000002.wal"
    assert len(list(records_since(wal, 0, 2))) == 3
    data = segment.read_bytes()
    segment.write_bytes(data[:-5])  # the last record cut short: never acknowledged, ignored
    assert len(list(records_since(wal, 0, 2))) == 2
    damaged = bytearray(data)
    damaged[30] ^= 0xFF  # inside the first record
    segment.write_bytes(bytes(damaged))
    with pytest.raises(CorruptFileError, match="CRC-32") as caught:
        list(records_since(wal, 0, 2))
    assert caught.value.path == str(segment)


def test_automatic_snapshots_every_versions_keep_the_newest(tmp_path):
    bank = KnowledgeBank(num_shards=2)
    bank.create_table("emb", dim=DIM)
    first = bank.enable_snapshots(tmp_path / "snaps", every_versions=10, keep=2, poll_seconds=0.05)
    assert bank.latest_snapshot() == first
    bank.update("emb", [1], np.ones((1, DIM)), version=5)
    time.sleep(0.3)
    assert bank.latest_snapshot() == first  # 5 versions: not yet
    bank.update("emb", [1], np.full((1, DIM), 2.0), version=10)
    wait_until(lambda: bank.latest_snapshot() != first, seconds=30)
    restored = KnowledgeBank.load(bank.latest_snapshot())
    np.testing.assert_array_equal(restored.lookup("emb", [1])[0], np.full((1, DIM), 2.0))
    for version in (20, 30, 40):
        before = bank.latest_snapshot()
        bank.update("emb", [2], np.ones((1, DIM)), version=version)
        wait_until(lambda: bank.latest_snapshot() != before, seconds=30)
    def names():
        return sorted(p for p in os.listdir(tmp_path / "snaps") if p.startswith("snapshot-"))

    # the snapshot is published (manifest) before the old ones are pruned: wait for the pruning
    wait_until(lambda: len(names()) == 2, seconds=30)
    assert names()[-1] == os.path.basename(bank.latest_snapshot())
    assert bank.status()["snapshots"]["snapshots"]["state"] == "running"
    bank.close()
    assert not bank._snapshots.running


def test_automatic_snapshots_every_seconds(tmp_path):
    bank = KnowledgeBank()
    bank.create_table("emb", dim=DIM)
    first = bank.enable_snapshots(tmp_path / "snaps", every_seconds=0.2, poll_seconds=0.05)
    wait_until(lambda: bank.latest_snapshot() != first, seconds=30)
    bank.close()


def test_snapshot_arguments_are_checked(tmp_path):
    bank = KnowledgeBank()
    bank.create_table("emb", dim=DIM)
    with pytest.raises(ValueError, match="snapshot\\(\\) needs a snapshot directory"):
        bank.snapshot()
    with pytest.raises(ValueError, match="keep"):
        bank.enable_snapshots(tmp_path / "a", keep=0)
    with pytest.raises(ValueError, match="every_seconds"):
        bank.enable_snapshots(tmp_path / "a", every_seconds=-1)
    with pytest.raises(TypeError, match="write_ahead_log"):
        bank.enable_snapshots(tmp_path / "a", write_ahead_log="yes")
    with pytest.raises(ValueError, match="local or mounted shared directory"):
        bank.enable_snapshots("memory://carlskit-wal-test", write_ahead_log=True)
    assert bank.recover() == {}  # in-process shards are never lost
