"""``durability="machine"``: an acknowledged write survives the loss of its machine's page cache.

Tested by what survives, not by trusting the call: on the workers, the log's ``fdatasync`` goes
through a layer that writes down, per segment file, how many bytes each sync covered (the file's
size when the sync started). Then the worker holding shard 1 is SIGKILLed and its machine's loss is
played by cutting every one of its log segments back to the bytes a sync covered (what a power loss
leaves of a file: the synced prefix). ``recover()`` replays what is left. With ``"machine"`` every
acknowledged write is back; with the default ``"process"`` (no syncs) the same run loses the shard's
writes since the snapshot, which shows the test can fail.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest
from process_helpers import checkout_cluster, kill_worker, wait_until

from carlskit.bank import KnowledgeBank, ShardLostError
from carlskit.bank._hashing import shard_of

DIM = 4


@pytest.fixture(scope="module")
def client():
    with checkout_cluster(2) as dask_client:
        yield dask_client


def _install_sync_recorder(client, record: pathlib.Path) -> None:
    """On every worker: each log sync first appends ``<segment path> <bytes covered>`` to ``record``."""

    def install(record=str(record)):
        import os as worker_os

        from carlskit.bank import _wal

        real = getattr(_wal, "_real_fdatasync", _wal._fdatasync)

        def recording_fdatasync(fd):
            covered = worker_os.fstat(fd).st_size  # bytes written before the sync starts
            real(fd)
            with open(record, "a") as handle:
                handle.write(f"{worker_os.readlink(f'/proc/self/fd/{fd}')} {covered}\n")

        _wal._real_fdatasync = real
        _wal._fdatasync = recording_fdatasync

    client.run(install)


def _lose_unsynced_bytes(wal_directory: pathlib.Path, shard: int, record: pathlib.Path) -> int:
    """Cut each of ``shard``'s segments to the bytes a sync covered (0 if none); bytes dropped."""
    synced: dict[str, int] = {}
    if record.exists():
        for line in record.read_text().splitlines():
            path, covered = line.rsplit(" ", 1)
            synced[path] = max(synced.get(path, 0), int(covered))
    dropped = 0
    for segment in sorted((wal_directory / f"shard-{shard:05d}").glob("*.wal")):
        size, keep = segment.stat().st_size, synced.get(str(segment.resolve()), 0)
        assert keep <= size
        os.truncate(segment, keep)
        dropped += size - keep
    return dropped


@pytest.mark.parametrize("durability", ["machine", "process"])
def test_acknowledged_writes_survive_losing_what_was_not_synced(client, tmp_path, durability):
    client.wait_for_workers(2, timeout=120)
    record = tmp_path / "syncs.txt"
    _install_sync_recorder(client, record)
    bank = KnowledgeBank(client, num_shards=2)
    assert len(set(bank.shard_workers)) == 2
    bank.create_table("emb", DIM, initializer="zeros", optimizer="sgd", learning_rate=1.0, max_pending=1)
    keys = np.arange(1, 201, dtype=np.int64)
    bank.update("emb", keys, np.ones((len(keys), DIM)), version=1)
    bank.enable_snapshots(tmp_path / "snaps", write_ahead_log=True, durability=durability, keep=2)
    rng = np.random.default_rng(0)
    for step in range(30):  # each call returns = acknowledged
        chosen = np.unique(rng.choice(keys, 20))
        if step % 2:
            bank.update("emb", chosen, np.full((len(chosen), DIM), float(step + 2)), version=step + 2)
        else:
            bank.apply_gradients("emb", chosen, np.full((len(chosen), DIM), 0.5))
    expected = bank.lookup("emb", keys)[0]
    meta = bank.row_metadata("emb", keys)

    kill_worker(client, bank.shard_workers[1])
    dropped = _lose_unsynced_bytes(tmp_path / "snaps" / "wal", 1, record)

    def lost() -> bool:
        try:
            bank.row_metadata("emb", keys[:4])
        except ShardLostError:
            return True
        return False

    wait_until(lost, 60)
    report = bank.recover()
    assert list(report) == [1]
    values = bank.lookup("emb", keys)[0]
    on_lost = shard_of(keys, 2) == 1
    np.testing.assert_array_equal(values[~on_lost], expected[~on_lost])
    if durability == "machine":
        assert dropped == 0 or report[1]["replayed_calls"] > 0
        np.testing.assert_array_equal(values[on_lost], expected[on_lost])
        np.testing.assert_array_equal(bank.row_metadata("emb", keys)["version"][on_lost], meta["version"][on_lost])
    else:  # nothing was synced: the machine's loss took the shard's log with it
        assert dropped > 0 and report[1]["replayed_calls"] == 0
        assert (values[on_lost] != expected[on_lost]).any(axis=1).sum() > 0
    bank.close()


def test_machine_durability_needs_the_log(tmp_path):
    bank = KnowledgeBank()
    bank.create_table("emb", DIM)
    with pytest.raises(ValueError, match="durability"):
        bank.enable_snapshots(tmp_path / "s", durability="machine")
    with pytest.raises(ValueError, match="durability"):
        bank.enable_snapshots(tmp_path / "s", write_ahead_log=True, durability="power")
    with pytest.raises(TypeError, match="durability"):
        bank.enable_snapshots(tmp_path / "s", write_ahead_log=True, durability=None)
    bank.close()
