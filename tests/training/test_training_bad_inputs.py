"""Bad input to the trainer and the checkpoint store: a clear error, and nothing changed or half-written."""

import os
import threading

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_trainer import Linear, data, mse

from carlskit.training import CheckpointStore, Trainer


def kernel(trainer):
    return np.asarray(trainer._state[0]["linear"]["kernel"][...]).copy()


def test_a_nan_loss_raises_and_leaves_model_step_and_checkpoints_unchanged(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    trainer = Trainer(Linear(), optax.sgd(0.1), mse, checkpoints=store, checkpoint_every=1)
    trainer.fit(data, 2, progress=False)
    before = kernel(trainer)

    def poisoned(step):
        batch = data(step)
        batch["y"][0] = np.nan
        return batch

    with pytest.raises(ValueError, match="non-finite loss .* step 3"):
        trainer.fit(poisoned, 1, progress=False)
    assert trainer.step == 2 and len(trainer.history) == 2 and store.versions() == [1, 2]
    np.testing.assert_array_equal(kernel(trainer), before)
    assert np.isfinite(np.asarray(trainer.model.linear.kernel[...])).all()


@pytest.mark.parametrize("loss_fn, error, message", [
    (lambda model, batch: (model(batch["x"]), {}), ValueError, r"scalar loss, got shape \(32,\)"),
    (lambda model, batch: (jnp.mean(model(batch["x"])), {"out": model(batch["x"])}),
     ValueError, r"metrics must be scalars, got shapes \{'out': \(32,\)\}"),
    (lambda model, batch: jnp.mean(model(batch["x"])), TypeError, r"must return \(loss, metrics: dict\)"),
])
def test_a_malformed_loss_fn_output_is_named_and_nothing_is_applied(loss_fn, error, message):
    trainer = Trainer(Linear(), optax.sgd(0.1), loss_fn)
    before = kernel(trainer)
    with pytest.raises(error, match=message):  # exactly the type _checks promises
        trainer.fit(data, 1, progress=False)
    assert trainer.step == 0 and trainer.history == []
    np.testing.assert_array_equal(kernel(trainer), before)


def held_data():
    """(event, data function): each batch waits until the event is set, so a fit stays running."""
    release = threading.Event()

    def slow(step):
        release.wait(30)
        return data(step)

    return release, slow


def test_argument_types_batches_and_a_second_concurrent_fit_are_errors():
    for bad, error in (("5", TypeError), (2.5, TypeError), (0, ValueError), (True, TypeError)):
        with pytest.raises(error, match="checkpoint_every"):  # TypeError for a non-int, ValueError for < 1
            Trainer(Linear(), optax.sgd(0.1), mse, checkpoint_every=bad)
    for kwargs, name in [({"loss_fn": "mse"}, "loss_fn"), ({"knowledge": 3}, "knowledge"),
                         ({"summaries": object()}, "summaries")]:
        with pytest.raises(TypeError, match=name):
            Trainer(Linear(), optax.sgd(0.1), **{"loss_fn": mse, **kwargs})
    trainer = Trainer(Linear(), optax.sgd(0.1), mse)
    with pytest.raises(TypeError, match="batch must be a dict.*tuple"):
        trainer.fit(lambda step: (1, 2), 1, progress=False)
    release, slow = held_data()
    handle = trainer.fit(slow, 3, block=False, progress=False)
    with pytest.raises(RuntimeError, match="already fitting"):
        trainer.fit(data, 1, progress=False)
    release.set()
    handle.wait()
    assert trainer.step == 3
    trainer.fit(data, 1, progress=False)  # allowed again once the first one ended
    assert trainer.step == 4


@pytest.mark.parametrize("tree, metadata, message", [
    ({"w": np.zeros(2), "bad": object()}, None, r"\[.bad.\].*object arrays"),
    ({"w": np.zeros(2), "bad": np.array([None, 1.0])}, None, r"\[.bad.\].*object arrays"),
    ({"w": np.zeros(2)}, {"when": object()}, "metadata must be JSON-serializable"),
    ({"w": np.zeros(2)}, ["not", "a", "dict"], "metadata must be a dict"),
])
def test_a_tree_that_needs_pickle_or_bad_metadata_writes_nothing(tmp_path, tree, metadata, message):
    store = CheckpointStore(tmp_path / "ckpt")
    store.save({"w": np.ones(2)}, version=1)
    with pytest.raises(TypeError, match=message):
        store.save(tree, version=2, metadata=metadata)
    assert store.versions() == [1]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["v000000000001.json", "v000000000001.npz"]
    store.save({"w": np.full(2, 3.0)}, version=2)  # the version is still free
    np.testing.assert_array_equal(store.load(2)[0]["['w']"], [3.0, 3.0])


def test_store_argument_types():
    with pytest.raises(TypeError, match="keep"):
        CheckpointStore("memory://rv-training-keep", keep=True)
    store = CheckpointStore("memory://rv-training-version")
    with pytest.raises(TypeError, match="version"):  # a bool is not an int: TypeError since issue 16 (was ValueError)
        store.save({"w": np.zeros(1)}, version=True)


def test_a_batch_of_the_wrong_shape_names_the_batch_and_applies_nothing():
    trainer = Trainer(Linear(), optax.sgd(0.1), mse)
    before = kernel(trainer)
    wrong = {"x": np.zeros((8, 5), np.float32), "y": np.zeros(8, np.float32)}
    with pytest.raises(TypeError, match=r"step 1 failed on the batch .*'x': \(\(8, 5\), 'float32'\)"):
        trainer.fit([wrong], 1, progress=False)
    assert trainer.step == 0
    np.testing.assert_array_equal(kernel(trainer), before)


def test_fitting_after_restoring_an_older_version_is_refused_before_any_step(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep=None)
    trainer = Trainer(Linear(), optax.sgd(0.1), mse, checkpoints=store, checkpoint_every=2)
    trainer.fit(data, 4, progress=False)
    trainer.restore(2)
    assert trainer.step == 2
    with pytest.raises(ValueError, match="holds version 4, newer than this trainer's step 2"):
        trainer.fit(data, 2, progress=False)  # used to train and silently keep the old run's v4
    assert trainer.step == 2 and len(trainer.history) == 4 and store.versions() == [2, 4]


def test_wait_with_a_timeout_on_a_running_fit_raises_instead_of_returning_a_partial_history():
    trainer = Trainer(Linear(), optax.sgd(0.1), mse)
    release, slow = held_data()
    handle = trainer.fit(slow, 2, block=False, progress=False)
    with pytest.raises(TimeoutError, match="still running"):
        handle.wait(timeout=0.05)
    release.set()
    assert len(handle.wait()) == 2
