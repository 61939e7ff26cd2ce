"""``Trainer.fit(client=...)``: the trainer's steps run on a worker of a chosen group (CARLS's
trainer beside its accelerator), with the bank on another group; a killed trainer worker costs at
most the steps since the last checkpoint."""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from process_helpers import connected_cluster, kill_worker, wait_until
from tiny_models import Linear

import carlskit
from carlskit.bank import KnowledgeBank
from carlskit.cluster import RestartPolicy
from carlskit.training import CheckpointStore, Trainer
from carlskit.widgets import ClusterStatus

TRUE_W = np.array([1.0, -2.0, 0.5, 3.0], np.float32)


def mse(model, batch):
    prediction = model(batch["x"]) + batch.get("offset", 0.0)
    return jnp.mean((prediction - batch["y"]) ** 2), {}


def batch_at(step):
    x = np.random.default_rng(step).normal(size=(16, 4)).astype(np.float32)
    return {"x": x, "y": x @ TRUE_W, "ids": np.arange(16) % 4}


def slow_batch_at(step):
    time.sleep(0.05)  # slow enough to kill the worker mid-fit
    return batch_at(step)


class BankOffset:
    """Knowledge read from the bank on whichever process trains: each item's stored offset."""

    def __init__(self, bank):
        self.bank = bank

    def __call__(self, batch):
        values, _ = self.bank.lookup("offset", batch["ids"])
        return {**batch, "offset": values[:, 0]}


@pytest.fixture(scope="module")
def groups():
    """One two-group cluster for the module; fails if it leaves processes behind (checked when it
    closes, not per test: the chaos test's replacement worker belongs to the cluster)."""
    with connected_cluster(worker_groups={
        "trainer": {"n_workers": 1, "devices": 2, "resources": {"accelerator": 1}},
        "makers": {"n_workers": 1, "resources": {"maker": 1}},
    }) as client:
        yield client


def test_fit_runs_on_the_accelerator_group_and_brings_back_what_a_local_fit_would(groups, tmp_path):
    client = groups
    report = carlskit.devices(client)
    (trainer_worker,), (maker_worker,) = report.group("trainer"), report.group("makers")
    bank = KnowledgeBank(client, num_shards=1)  # default placement: off the accelerator worker
    assert bank.shard_workers == [maker_worker["process"]]
    bank.create_table("offset", dim=1, initializer="zeros")
    bank.update("offset", np.arange(4), np.zeros((4, 1), np.float32), version=0)
    logged = []

    class Scalars:
        def scalar(self, name, value, step):
            logged.append((name, step))

    remote = Trainer(Linear(), optax.adam(0.05), mse, knowledge=BankOffset(bank),
                     checkpoints=CheckpointStore(tmp_path / "remote"), checkpoint_every=10, summaries=Scalars())
    local = Trainer(Linear(), optax.adam(0.05), mse, knowledge=BankOffset(bank),
                    checkpoints=CheckpointStore(tmp_path / "local"), checkpoint_every=10)
    assert remote.status()["runs on"] == "this process"
    history = remote.fit(batch_at, 30, client=client, progress=False)
    local.fit(batch_at, 30, progress=False)

    placed = remote.last_placement
    assert (placed["worker"], placed["group"], placed["device_count"]) == (trainer_worker["process"], "trainer", 2)
    assert placed["resources"] == {"accelerator": 1} and placed["resumed_from"] == 0
    status = remote.status()  # what ClusterStatus(sources=[trainer]) shows
    assert (status["runs on"], status["group"], status["step"]) == (trainer_worker["process"], "trainer", 30)
    board = ClusterStatus(client, sources=[remote], show_devices=False)._repr_html_()
    assert "<h4>Trainer</h4>" in board and "runs on" in board
    assert remote.step == 30 and [r["step"] for r in history] == list(range(1, 31))
    assert [name for name, step in logged if step == 30] == ["train/loss", "train/step_seconds"], \
        "the local summaries got every record"
    assert remote.checkpoints.versions() == [10, 20, 30], "the worker published into the shared store"
    # Same steps, same batches: the same weights as training here (two devices vs one: float noise).
    np.testing.assert_allclose(remote.model.linear.kernel[...], local.model.linear.kernel[...], atol=1e-5)
    np.testing.assert_allclose([r["loss"] for r in history], [r["loss"] for r in local.history], rtol=1e-4)
    # The model came back: it predicts here, and a second remote fit goes on from step 30.
    remote.fit(batch_at, 5, client=client, workers=["trainer-0"], progress=False)
    assert remote.step == 35 and len(remote.history) == 35
    with pytest.raises(ValueError, match="client="):
        remote.fit(batch_at, 1, workers=["trainer-0"])
    with pytest.raises(TypeError, match="workers"):
        remote.fit(batch_at, 1, client=client, workers=3)
    assert remote.step == 35, "a refused fit changed nothing"
    bank.close()


def test_a_killed_trainer_worker_costs_at_most_the_steps_since_the_last_checkpoint(groups, tmp_path):
    client = groups
    (trainer_worker,) = carlskit.devices(client).group("trainer")
    trainer = Trainer(Linear(), optax.adam(0.05), mse, checkpoints=CheckpointStore(tmp_path), checkpoint_every=10)
    handle = trainer.fit(slow_batch_at, 80, client=client, block=False, progress=False,
                         restart_policy=RestartPolicy(budget_seconds=180, max_delay_seconds=2.0))
    wait_until(lambda: len(trainer.history) >= 25, seconds=120)
    kill_worker(client, trainer_worker["process"])
    history = handle.wait(timeout=240)
    steps = [r["step"] for r in history]
    resumed = trainer.last_placement["resumed_from"]
    assert trainer.step == 80 and steps == sorted(set(steps)) and steps[-1] == 80, "no step twice, none redone"
    assert 20 <= resumed < 80 and resumed % 10 == 0, f"resumed from checkpoint {resumed}"
    # Records not yet reported when the worker died (at most half a second of steps) and kept by
    # the checkpoint it resumed from are the history's only gap.
    missing = sorted(set(range(1, 81)) - set(steps))
    assert all(resumed - 12 < step <= resumed for step in missing), (missing, resumed)
    assert (trainer.last_placement["group"] == "trainer"
            and trainer.last_placement["worker"] != trainer_worker["process"])
    reference = Trainer(Linear(), optax.adam(0.05), mse)
    reference.fit(batch_at, 80, progress=False)
    np.testing.assert_allclose(trainer.model.linear.kernel[...], reference.model.linear.kernel[...], atol=1e-5)
    print(f"killed at step >= 25, resumed from checkpoint {resumed}, remote restarts {trainer.remote_restarts}")
