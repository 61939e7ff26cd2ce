import json
import os
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny_models import Linear

from carlskit.training import CheckpointStore, Trainer


def mse(model, batch):
    error = model(batch["x"]) - batch["y"]
    return jnp.mean(error**2), {"max_error": jnp.max(jnp.abs(error))}


TRUE_W = np.array([1.0, -2.0, 0.5, 3.0], np.float32)


def data(step):
    rng = np.random.default_rng(step)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    return {"x": x, "y": x @ TRUE_W}


def test_fit_learns_checkpoints_and_resumes(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep=3)
    trainer = Trainer(Linear(), optax.adam(0.1), mse, checkpoints=store, checkpoint_every=25)
    before = time.time()
    history = trainer.fit(data, 100, progress=False)
    assert len(history) == 100 and history[-1]["step"] == 100
    ends = [r["wall_time"] for r in history]  # when each step ended: throughput from the records alone
    assert before <= ends[0] and np.all(np.diff(ends) >= 0) and ends[-1] <= time.time()
    assert history[-1]["loss"] < 0.01 * history[0]["loss"]
    assert "max_error" in history[-1]
    assert store.versions() == [50, 75, 100]
    np.testing.assert_allclose(np.asarray(trainer.model.linear.kernel[...])[:, 0], TRUE_W, atol=0.1)

    resumed = Trainer(Linear(seed=9), optax.adam(0.1), mse, checkpoints=store, checkpoint_every=25)
    assert resumed.step == 100
    np.testing.assert_array_equal(resumed.model.linear.kernel[...], trainer.model.linear.kernel[...])
    resumed.fit(data, 5, progress=False)
    assert resumed.step == 105


def test_knowledge_runs_in_the_prefetch_thread_and_statistics_are_logged():
    threads = set()

    def knowledge(batch):
        threads.add(threading.current_thread().name)
        return {**batch, "_embedding_version": 0.0, "_missing_neighbors": 2}

    trainer = Trainer(Linear(), optax.sgd(0.01), mse, knowledge=knowledge)
    history = trainer.fit(data, 3, progress=False)
    assert threads == {"carlskit-prefetch"}
    assert [r["staleness"] for r in history] == [0.0, 1.0, 2.0]
    assert history[0]["missing_neighbors"] == 2


def test_background_fit_can_be_stopped_and_errors_surface():
    trainer = Trainer(Linear(), optax.sgd(0.01), mse)
    handle = trainer.fit(data, 1_000_000, block=False, progress=False)
    while trainer.step < 3:
        pass
    handle.stop()
    assert handle.done and 3 <= trainer.step < 1_000_000

    def broken(step):
        if step == 2:
            raise RuntimeError("data source failed at step 2")
        return data(step)

    handle = Trainer(Linear(), optax.sgd(0.01), mse).fit(broken, 10, block=False, progress=False)
    with pytest.raises(RuntimeError, match="step 2"):
        handle.wait()


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="model"):
        Trainer(object(), optax.sgd(0.1), mse)
    with pytest.raises(TypeError, match="optimizer"):
        Trainer(Linear(), "adam", mse)
    with pytest.raises(ValueError, match="steps"):
        Trainer(Linear(), optax.sgd(0.1), mse).fit(data, 0)


DATA_PARALLEL = r"""
import json, numpy as np, jax, optax
import test_trainer as t
from carlskit.training import Trainer
trainer = Trainer(t.Linear(), optax.sgd(0.05), t.mse)
history = trainer.fit(t.data, 5, progress=False)
placed = trainer._place(t.data(0))["x"]
shards = len(placed.sharding.device_set) if hasattr(placed, "sharding") else 1
print(json.dumps({"devices": len(jax.devices()), "losses": [r["loss"] for r in history],
                  "batch_shards": shards}))
"""


def test_data_parallel_over_8_devices_matches_one_device():
    results = []
    for flags in ("", "--xla_force_host_platform_device_count=8"):
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu",
               "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__)),
                                              os.environ.get("PYTHONPATH", "")])}
        out = subprocess.run([sys.executable, "-c", DATA_PARALLEL], env=env, capture_output=True, text=True,
                             timeout=240)
        assert out.returncode == 0, out.stderr[-2000:]
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    one, eight = results
    assert one["devices"] == 1 and eight["devices"] == 8 and eight["batch_shards"] == 8
    np.testing.assert_allclose(one["losses"], eight["losses"], rtol=1e-5)


LOCAL_LOSSES = r"""
import json, re, numpy as np, jax, jax.numpy as jnp, optax
from flax import nnx
import tiny_models
from carlskit.training import Trainer


class Tracking(tiny_models.MLP):  # writes a non-Param variable in its loss: a batch statistic
    def __init__(self):
        super().__init__(seed=0)
        self.seen_mean = nnx.BatchStat(jnp.zeros(4))


def mean_loss(model, batch):
    model.seen_mean.value = batch["x"].mean(axis=0)
    error = model(batch["x"]) - batch["y"]
    return jnp.mean(error ** 2), {"mae": jnp.mean(jnp.abs(error))}


def coupled_loss(model, batch):  # rows coupled: each prediction against the whole batch's mean
    out = model(batch["x"])
    return jnp.mean((out - out.mean() - batch["y"]) ** 2), {}


def run(loss, mode):
    trainer = Trainer(Tracking(), optax.adam(0.05), loss, data_parallel=mode)
    history = trainer.fit(tiny_models.sum_batch_16, 6, progress=False, live=False)
    trainer.sync()
    placed = trainer._place(tiny_models.sum_batch_16(0))
    hlo = trainer._train_step.lower(trainer._state, placed).compile().as_text()
    operands = [len(re.findall(r"%[\w.-]+", line.split("all-reduce(", 1)[1].split(")", 1)[0]))
                for line in hlo.splitlines() if " all-reduce(" in line]
    return {"losses": [r["loss"] for r in history], "mae": [r.get("mae") for r in history],
            "params": [np.asarray(x).tolist() for x in jax.tree.leaves(nnx.state(trainer.model, nnx.Param))],
            "seen_mean": np.asarray(trainer.model.seen_mean.value).tolist(), "all_reduce_operands": operands}


losses = (("mean", mean_loss), ("coupled", coupled_loss))
print(json.dumps({"devices": jax.device_count(),
                  **{f"{name}_{mode}": run(loss, mode) for name, loss in losses for mode in ("global", "local")}}))
"""


def test_local_losses_equal_the_global_step_for_a_mean_loss_in_one_all_reduce():
    """data_parallel="local" over 8 devices: a mean loss reaches the global step's losses, metrics,
    parameters and written batch statistic, with one single-buffer all-reduce per step where the
    global step reduces one operand per parameter; a loss that couples rows sees each device's own."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__)),
                                          os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", LOCAL_LOSSES], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["devices"] == 8
    glob, local = got["mean_global"], got["mean_local"]
    for key in ("losses", "mae", "seen_mean"):
        np.testing.assert_allclose(local[key], glob[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for a, b in zip(local["params"], glob["params"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert local["all_reduce_operands"] == [1], local["all_reduce_operands"]
    assert max(glob["all_reduce_operands"]) >= 4, glob["all_reduce_operands"]  # one per parameter (and more)
    # the coupled loss: the first step's loss is the same batch, but each device centres on its own rows
    assert abs(got["coupled_local"]["losses"][0] - got["coupled_global"]["losses"][0]) > 1e-3


def test_local_losses_refuse_what_they_cannot_train():
    with pytest.raises(ValueError, match="data_parallel"):
        Trainer(Linear(), optax.sgd(0.1), mse, data_parallel="ddp")
    with pytest.raises(TypeError, match="data_parallel"):
        Trainer(Linear(), optax.sgd(0.1), mse, data_parallel=1)


def test_trainer_logs_every_step_to_summaries(tmp_path):
    from carlskit.summaries import SummaryReader, SummaryWriter

    with SummaryWriter(tmp_path / "logs") as writer:
        trainer = Trainer(Linear(), optax.sgd(0.01), mse, summaries=writer)
        history = trainer.fit(data, 7, progress=False)
    frame = SummaryReader(tmp_path / "logs").scalars("train/loss")
    assert list(frame["step"]) == list(range(1, 8))
    np.testing.assert_allclose(frame["value"], [r["loss"] for r in history], rtol=1e-6)


def test_the_model_stays_usable_while_training_runs_in_the_background(tmp_path):
    trainer = Trainer(Linear(), optax.sgd(0.01), mse, checkpoints=tmp_path / "ckpt")  # a Path works too
    handle = trainer.fit(data, 200, block=False, progress=False)
    for _ in range(20):  # evaluate reads synced copies, never arrays a step has donated
        predictions = trainer.evaluate(lambda model: model(jnp.ones((2, 4))))
        assert np.isfinite(np.asarray(predictions)).all()
    handle.wait()
    with pytest.raises(ValueError, match="prefetch"):
        Trainer(Linear(), optax.sgd(0.1), mse, prefetch=0)


def poisoned_from_step_6(step):
    """From step 6 on (a checkpoint step), the batch makes the gradient NaN while the loss stays finite."""
    return {**data(step), "poison": np.float32(step >= 5)}


def mse_with_nan_gradients(model, batch):
    loss, metrics = mse(model, batch)
    # 0 * sqrt(u): the value is 0, but at u = 0 the gradient is 0 * inf = NaN (u = 0 when poisoned).
    u = jnp.sum(model.linear.bias[...] * 0.0) + 1.0 - batch["poison"]
    return loss + 0.0 * jnp.sqrt(u), metrics


def test_nan_gradients_under_a_finite_loss_stop_fit_and_no_checkpoint_holds_a_nan(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep=None)
    trainer = Trainer(Linear(), optax.sgd(0.01), mse_with_nan_gradients, checkpoints=store, checkpoint_every=2)
    with pytest.raises(ValueError, match=r"step 6 produced non-finite weights .* as after step 5"):
        trainer.fit(poisoned_from_step_6, 10, progress=False)
    assert trainer.step == 5 and store.versions() == [2, 4]
    assert np.isfinite(np.asarray(trainer.model.linear.kernel[...])).all()
    for version in store.versions():
        arrays, _ = store.load(version)
        assert all(np.isfinite(a).all() for a in arrays.values() if np.issubdtype(a.dtype, np.floating))


def test_a_checkpoint_with_nan_leaves_is_refused_and_nothing_is_written(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep=None)
    tree = {"model": {"w": np.array([1.0, np.nan], np.float32)}, "opt": {"mu": np.array([np.inf])}}
    with pytest.raises(ValueError,
                       match=r"version 3 not saved: leaves \[\"\['model'\]\['w'\]\", \"\['opt'\]\['mu'\]\"\] hold NaN"):
        store.save(tree, version=3, check_finite=True)
    assert store.versions() == [] and list((tmp_path / "ckpt").iterdir()) == []
