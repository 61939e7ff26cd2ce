"""KnowledgeBank on a Dask LocalCluster: same results as in-process, several writer processes,
no partial writes, snapshots across modes, and a clear error when a shard's worker dies."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")

from carlskit.bank import KnowledgeBank, ShardLostError  # noqa: E402
from carlskit.cluster import live_workers  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DIM = 8


def fill(kb):
    rng = np.random.default_rng(0)
    kb.create_table("emb", dim=DIM, seed=3, learning_rate=0.5, max_pending=4)
    kb.create_feature_table("nbrs", {"ids": ("int64", 2)})
    keys = np.arange(1, 401)
    kb.lookup("emb", keys, insert_missing=True)
    kb.update("emb", keys[:100], rng.normal(size=(100, DIM)), version=2)
    for _ in range(3):
        kb.apply_gradients("emb", keys[50:250], rng.normal(size=(200, DIM)))
    kb.lookup("emb", keys[:120])
    kb.update("nbrs", keys[:5], {"ids": np.arange(10).reshape(5, 2)}, version=1)
    return keys


def test_distributed_matches_in_process(client):
    remote, local = KnowledgeBank(client, num_shards=2), KnowledgeBank(num_shards=2)
    assert len(set(remote.shard_workers)) == 2  # one shard per worker
    keys = fill(remote)
    fill(local)
    for table in ("emb", "nbrs"):
        a, found_a = remote.lookup(table, np.r_[keys, [9999]])
        b, found_b = local.lookup(table, np.r_[keys, [9999]])
        np.testing.assert_array_equal(found_a, found_b)
        if table == "emb":
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_array_equal(a["ids"], b["ids"])
    queries = np.random.default_rng(1).normal(size=(16, DIM)).astype(np.float32)
    for metric in ("dot", "cosine", "l2"):
        np.testing.assert_array_equal(remote.nearest("emb", queries, k=7, metric=metric)[0],
                                      local.nearest("emb", queries, k=7, metric=metric)[0])
    np.testing.assert_array_equal(remote.sample("emb", 100, seed=2), local.sample("emb", 100, seed=2))
    meta_a, meta_b = remote.row_metadata("emb", keys), local.row_metadata("emb", keys)
    for name in ("found", "version", "lookup_count"):
        np.testing.assert_array_equal(meta_a[name], meta_b[name])
    stats_a, stats_b = remote.stats()["tables"]["emb"], local.stats()["tables"]["emb"]
    for name in ("rows_per_shard", "pending_gradients", "gradients_applied", "optimizer_steps"):
        assert stats_a[name] == stats_b[name], name
    assert remote.stats()["distributed"]
    remote.close()


def read_in_task(bank, keys):
    values, found = bank.lookup("emb", keys)
    bank.apply_gradients("emb", keys, np.zeros_like(values))
    return values, found


def test_bank_passed_into_a_dask_task(client):
    kb = KnowledgeBank(client, num_shards=2)
    keys = fill(kb)[:50]
    expected, _ = kb.lookup("emb", keys)
    values, found = client.submit(read_in_task, kb, keys, pure=False).result()
    assert found.all()
    np.testing.assert_array_equal(values, expected)
    assert kb.stats()["tables"]["emb"]["pending_gradients"] >= 50
    with pytest.raises(TypeError, match="in-process"):
        import pickle
        pickle.dumps(KnowledgeBank())
    kb.close()


def test_bad_batch_changes_no_shard(client, bank_contents, assert_same_contents):
    kb = KnowledgeBank(client, num_shards=2)
    keys = fill(kb)
    before = bank_contents(kb)
    values = np.ones((len(keys), DIM))
    values[-1, 0] = np.nan  # one bad row: no shard may be written
    with pytest.raises(ValueError, match="NaN"):
        kb.update("emb", keys, values, version=5)
    with pytest.raises(ValueError, match="-1"):
        kb.apply_gradients("emb", np.r_[keys[:-1], [-1]], np.ones((len(keys), DIM)))
    assert_same_contents(before, bank_contents(kb))
    kb.close()


WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from distributed import Client
    from carlskit.bank import KnowledgeBank
    address, name, grad = sys.argv[1], sys.argv[2], float(sys.argv[3])
    with Client(address) as client:
        kb = KnowledgeBank.attach(client, name)
        assert kb.transport == "direct", kb.transport  # attached banks get the direct path too
        keys = np.arange(1, 1001)
        for _ in range(20):
            kb.apply_gradients("emb", keys, np.full((len(keys), 4), grad, np.float32))
    print("done")
""")


def test_two_processes_write_gradients_to_the_same_keys(client):
    kb = KnowledgeBank(client, num_shards=2)
    kb.create_table("emb", dim=4, initializer="zeros", learning_rate=1.0,
                    max_pending=1000, pending_ttl_seconds=float("inf"))
    kb.publish("carlskit-test-bank")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, client.scheduler.address,
                                 "carlskit-test-bank", grad], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for grad in ("1.0", "3.0")]
    for writer in writers:
        out, err = writer.communicate(timeout=120)
        assert writer.returncode == 0, err
    stats = kb.stats()["tables"]["emb"]
    assert stats["gradients_received"] == 2 * 20 * 1000
    assert stats["pending_gradients"] == 2 * 20 * 1000  # every gradient of both processes cached
    values, _ = kb.lookup("emb", np.arange(1, 1001))
    np.testing.assert_allclose(values, -2.0)  # one step with the average of 20 x 1.0 and 20 x 3.0
    assert kb.stats()["tables"]["emb"]["gradients_applied"] == 2 * 20 * 1000
    client.unpublish_dataset("carlskit-test-bank")
    kb.close()


def test_snapshot_between_modes(client, tmp_path, bank_contents, assert_same_contents):
    kb = KnowledgeBank(client, num_shards=2)
    fill(kb)
    kb.save(tmp_path / "snap")
    expected = bank_contents(kb)
    local = KnowledgeBank.load(tmp_path / "snap", num_shards=3)
    assert_same_contents(expected, bank_contents(local))
    local.save(tmp_path / "snap3")
    back = KnowledgeBank.load(tmp_path / "snap3", client=client, num_shards=2)
    assert back.distributed
    assert_same_contents(expected, bank_contents(back))
    kb.close()
    back.close()


def test_batches_in_flight_match_blocking_calls(client, bank_contents, assert_same_contents):
    """lookup_async / apply_gradients_async with several batches in flight give what the blocking
    calls give; the caller may overwrite its buffers at once; bad input raises before sending."""
    remote, local = KnowledgeBank(client, num_shards=2), KnowledgeBank(num_shards=2)
    rng = np.random.default_rng(5)
    for kb in (remote, local):
        # max_pending above the gradients a key gets: in-flight calls may reach a shard in any
        # order, and the flush below averages all of them whatever their order was
        kb.create_table("emb", dim=DIM, seed=1, learning_rate=0.5, max_pending=100)
        kb.create_feature_table("nbrs", {"ids": ("int64", 2)})
    batches = [rng.integers(1, 300, 64) for _ in range(6)]
    gradients = [rng.normal(size=(64, DIM)).astype(np.float32) for _ in range(6)]
    buffer_keys, buffer_gradients = np.empty(64, np.int64), np.empty((64, DIM), np.float32)
    pending = []
    for keys, grads in zip(batches, gradients):
        buffer_keys[:], buffer_gradients[:] = keys, grads
        pending.append(remote.apply_gradients_async("emb", buffer_keys, buffer_gradients))
        buffer_keys[:], buffer_gradients[:] = -7, np.nan  # reused before the call was sent
        local.apply_gradients("emb", keys, grads)
    assert all(future.result() is None for future in pending)
    assert all(future.done() for future in pending)
    assert remote.stats()["tables"]["emb"]["pending_gradients"] == 6 * 64
    remote.flush(), local.flush()
    in_flight = [remote.lookup_async("emb", keys) for keys in batches]
    in_flight.append(remote.lookup_async("nbrs", batches[0], insert_missing=True))
    for keys, future in zip(batches, in_flight):
        values, found = future.result()
        expected, expected_found = local.lookup("emb", keys)
        np.testing.assert_allclose(values, expected, rtol=1e-5, atol=1e-6)  # summation order
        np.testing.assert_array_equal(found, expected_found)
        assert future.result()[0] is values  # waited for once, then the same answer
    records, found = in_flight[-1].result()
    assert not found.any() and (records["ids"] == -1).all()
    one_shard = KnowledgeBank(client, num_shards=1)
    one_shard.create_table("emb", dim=DIM)
    # 20,000 keys (160 KB): ZeroMQ sends frames over 64 KB from the caller's buffer, later, on its
    # I/O thread; a single shard gets the keys without routing, so the call needs its own copy
    keys = np.arange(10, 20_010)
    future = one_shard.lookup_async("emb", keys, insert_missing=True)
    keys[:] = 10**9
    np.testing.assert_array_equal(future.result()[0], one_shard.lookup("emb", np.arange(10, 20_010))[0])
    assert not one_shard.lookup("emb", [10**9])[1].any()
    before = bank_contents(remote)
    with pytest.raises(ValueError, match=r"gradients must have shape \[64, 8\]"):
        remote.apply_gradients_async("emb", batches[0], np.ones((63, DIM)))
    with pytest.raises(ValueError, match="-1"):
        remote.lookup_async("emb", np.r_[batches[0], [-1]])
    assert_same_contents(before, bank_contents(remote))
    for kb in (remote, one_shard):
        kb.close()


def _minor_page_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "dask"])
def test_shard_workers_reuse_memory_for_batch_results(client, direct):
    """A 4096 x 64 result is 1 MiB (256 pages). Under Dask's MALLOC_TRIM_THRESHOLD_ every such
    array was a fresh mmap, faulted in page by page; shard workers now reuse freed heap memory.
    The direct path's server thread has a malloc arena of its own, which grows over its first
    calls (replies are freed once ZeroMQ has sent them): hence the longer warm-up."""
    kb = KnowledgeBank(client, num_shards=1, direct=direct)
    assert kb.transport == ("direct" if direct else "dask")
    kb.create_table("emb", dim=64, capacity=4096)
    keys = np.arange(4096)
    kb.lookup("emb", keys, insert_missing=True)
    worker = kb.shard_workers[0]
    for _ in range(300):
        kb.lookup("emb", keys)  # warm the worker's heap
    before = client.run(_minor_page_faults, workers=[worker])[worker]
    calls = 20
    for _ in range(calls):
        kb.lookup("emb", keys)
    faults = client.run(_minor_page_faults, workers=[worker])[worker] - before
    pages_per_result = 4096 * 64 * 4 // 4096
    assert faults < calls * pages_per_result // 4, faults  # measured: 6859 without the fix
    kb.close()


def test_lost_shard_worker_is_named_and_snapshot_restores(client, tmp_path):
    """Kills a worker of the module's cluster, so it is defined last in this file (pytest runs a
    module's tests in file order): no test shares the cluster after the kill."""
    kb = KnowledgeBank(client, num_shards=2)
    keys = fill(kb)
    kb.save(tmp_path / "snap")
    expected, _ = kb.lookup("emb", keys)
    worker_pid = client.run(os.getpid, workers=[kb.shard_workers[1]])[kb.shard_workers[1]]
    os.kill(worker_pid, signal.SIGKILL)
    with pytest.raises(ShardLostError, match="shard 1 of 2"):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the death is noticed
            kb.lookup("emb", keys)
            time.sleep(0.02)
    dead = kb.shard_workers[1]
    deadline = time.monotonic() + 60
    while dead in live_workers(client):  # the scheduler forgets the dead worker
        if time.monotonic() > deadline:  # (its nanny restarts it later under a new address)
            pytest.fail(f"the scheduler still lists the killed worker {dead} after 60 s")
        time.sleep(0.05)
    restored = KnowledgeBank.load(tmp_path / "snap", client=client)  # on the workers alive now
    np.testing.assert_array_equal(restored.lookup("emb", keys)[0], expected)
    restored.close()
