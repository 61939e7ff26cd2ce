"""Trainer.fit(client=..., processes=2): data parallel over the global mesh of two processes' devices
(gloo on CPU), equal to a one-process fit on the same global batches; one checkpoint stream; a lost
worker relaunches the group from the newest checkpoint."""

from __future__ import annotations

import threading

import jax
import numpy as np
import optax
import psutil
import pytest
import tiny_models
from flax import nnx
from process_helpers import checkout_cluster, kill_worker, wait_until

from carlskit import RankFailedError, RestartPolicy
from carlskit.checkpoints import CheckpointStore
from carlskit.cluster import live_workers
from carlskit.training import Trainer

pytestmark = pytest.mark.slow
STEPS = 8


@pytest.fixture(scope="module")
def client():
    with checkout_cluster(2) as client:
        yield client


def parameters(trainer: Trainer) -> list[np.ndarray]:
    trainer.sync()
    return [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(trainer.model, nnx.Param))]


def new_trainer(**kwargs) -> Trainer:
    return Trainer(tiny_models.MLP(seed=0), optax.adam(0.05), tiny_models.mse, **kwargs)


@pytest.fixture(scope="module")
def one_process():
    """The reference: the same fit in this one process."""
    trainer = new_trainer()
    trainer.fit(tiny_models.sum_batch_16, STEPS, progress=False, live=False)
    return trainer


def test_a_two_process_fit_equals_the_one_process_fit_on_the_same_global_batches(client, one_process, tmp_path):
    trainer = new_trainer(checkpoints=tmp_path / "ckpt", checkpoint_every=4)
    history = trainer.fit(tiny_models.sum_batch_16, STEPS, client=client, processes=2, devices_per_process=4,
                          progress=False, live=False)
    assert trainer.step == STEPS
    assert [r["step"] for r in history] == list(range(1, STEPS + 1))  # rank 0's records, once each
    np.testing.assert_allclose([r["loss"] for r in history], [r["loss"] for r in one_process.history],
                               rtol=1e-5, atol=1e-6)
    for got, want in zip(parameters(trainer), parameters(one_process)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert trainer.last_placement["processes"] == 2 and trainer.last_placement["device_count"] == 8
    # one checkpoint stream, written by process 0, restorable by a one-process trainer
    assert CheckpointStore(tmp_path / "ckpt").versions() == [4, 8]
    restored = new_trainer(checkpoints=tmp_path / "ckpt")
    assert restored.step == STEPS
    for got, want in zip(parameters(restored), parameters(trainer)):
        np.testing.assert_array_equal(got, want)


def test_local_losses_over_two_processes_equal_the_one_process_fit(client, one_process):
    """data_parallel="local": each of 2 x 4 devices differentiates its own rows' mean loss, one flat
    all-reduce across the processes averages them: the one-process (global) fit's losses and weights."""
    trainer = new_trainer(data_parallel="local")
    history = trainer.fit(tiny_models.sum_batch_16, STEPS, client=client, processes=2, devices_per_process=4,
                          progress=False, live=False)
    assert trainer.step == STEPS and trainer.data_parallel == "local"
    np.testing.assert_allclose([r["loss"] for r in history], [r["loss"] for r in one_process.history],
                               rtol=1e-5, atol=1e-6)
    for got, want in zip(parameters(trainer), parameters(one_process)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_lost_worker_mid_fit_relaunches_the_group_from_its_newest_checkpoint(client, one_process, tmp_path):
    store = tmp_path / "ckpt"
    trainer = new_trainer(checkpoints=store, checkpoint_every=2)
    victim = sorted(live_workers(client))[1]

    def kill_after_a_checkpoint():
        wait_until(lambda: (CheckpointStore(store).latest() or 0) >= 2, seconds=120)
        kill_worker(client, victim)

    threading.Thread(target=kill_after_a_checkpoint, daemon=True).start()
    trainer.fit(tiny_models.slow_sum_batch_16, STEPS, client=client, processes=2, devices_per_process=4,
                progress=False, live=False,
                restart_policy=RestartPolicy(budget_seconds=180, initial_delay_seconds=1.0))
    assert trainer.remote_restarts == 1
    assert trainer.step == STEPS and [r["step"] for r in trainer.history] == list(range(1, STEPS + 1))
    assert trainer.last_placement["resumed_from"] >= 2  # the relaunch started from a checkpoint
    for got, want in zip(parameters(trainer), parameters(one_process)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    client.wait_for_workers(2, timeout=120)


def test_stopping_a_background_group_fit_ends_its_ranks_at_the_newest_checkpoint(client, tmp_path):
    store = tmp_path / "ckpt"
    trainer = new_trainer(checkpoints=store, checkpoint_every=2)
    handle = trainer.fit(tiny_models.slow_sum_batch_16, 200, client=client, processes=2, devices_per_process=4,
                         progress=False, live=False, block=False)
    wait_until(lambda: (CheckpointStore(store).latest() or 0) >= 4, seconds=120)
    handle.stop()
    assert handle.done
    latest = CheckpointStore(store).latest()
    assert 4 <= latest < 200 and trainer.step == latest  # the trainer holds the newest checkpoint
    assert [r["step"] for r in trainer.history] == list(range(1, latest + 1))
    wait_until(lambda: not [p for p in psutil.process_iter(["cmdline"])
                            if "carlskit.cluster._rank" in " ".join(p.info["cmdline"] or ())], seconds=10)


def test_a_rank_failing_ends_the_group_fit_with_the_ranks_error(client):
    trainer = new_trainer()

    def bad_batch(step):
        return {"x": np.zeros((16, 3), np.float32), "y": np.zeros(16, np.float32)}  # 3 features, not 4

    with pytest.raises(RankFailedError, match=r"rank [01] raised TypeError: step 1 failed on the batch"):
        trainer.fit(bad_batch, 2, client=client, processes=2, devices_per_process=4, progress=False, live=False)
    assert trainer.step == 0


def test_processes_needs_a_client_and_devices_per_process_needs_processes(client):
    trainer = new_trainer()
    with pytest.raises(ValueError, match="client"):
        trainer.fit(tiny_models.sum_batch_16, 1, processes=2)
    with pytest.raises(ValueError, match="processes"):
        trainer.fit(tiny_models.sum_batch_16, 1, client=client, devices_per_process=2)
    with pytest.raises(ValueError, match="processes"):
        trainer.fit(tiny_models.sum_batch_16, 1, client=client, processes=0)
    assert trainer.step == 0 and not trainer.history
