"""Gradient store and learner of the meta-training cluster, in-process (no Dask)."""

import logging

import jax
import numpy as np
import optax
import pytest

from carlskit.lopt import GradientStore, LearnableAdamRule, Learner

RULE = LearnableAdamRule()


def record(outer_step, grad, family="quad", id=None, loss=1.0):
    return {"id": id or f"{outer_step}-{np.random.default_rng().integers(1 << 60)}",
            "grad": [np.asarray(g, np.float32) for g in grad], "outer_step": outer_step,
            "task_family": family, "losses": np.zeros((2, 2)), "outer_loss": loss, "worker": 0, "seconds": 0.0}


def leaves(learner):
    return [np.asarray(x) for x in learner.current()[1]]


def grad_like(learner, value):
    return [np.full(np.shape(x), value, np.float32) for x in learner.current()[1]]


def make_learner(tmp_path, store=None, **options):
    options.setdefault("outer_optimizer", optax.sgd(1.0))
    return Learner(RULE, GradientStore() if store is None else store, str(tmp_path / "ckpt"), **options)


def test_store_puts_and_takes_batches_oldest_first_once_per_id():
    store = GradientStore(max_records=3)
    assert store.put_many([{"id": "a"}, {"id": "b"}, {"id": "a"}]) == 2
    assert store.put_many([{"id": "c"}, {"id": "d"}]) == 2  # "a" overflows: oldest dropped
    assert [r["id"] for r in store.take_many(2)] == ["b", "c"]
    assert [r["id"] for r in store.take_many(10)] == ["d"] and store.take_many(5) == []
    assert store.status() == {"pending": 0, "puts": 4, "takes": 3, "overflowed": 1, "duplicates": 1}
    with pytest.raises(TypeError, match="records"):
        store.put_many([{"no_id": 1}])
    with pytest.raises(ValueError, match="max_records"):
        store.take_many(0)


def test_learner_averages_fresh_gradients_and_drops_stale_ones(tmp_path):
    store = GradientStore()
    learner = make_learner(tmp_path, store, max_staleness=1)
    start = leaves(learner)
    store.put_many([record(0, grad_like(learner, 1.0)), record(0, grad_like(learner, 3.0), family="other")])
    assert learner.update()["applied"] == 2
    # SGD(1): theta <- theta - mean(grad) = theta - 2
    np.testing.assert_allclose(np.concatenate([a.ravel() for a in leaves(learner)]),
                               np.concatenate([a.ravel() - 2.0 for a in start]), rtol=1e-6)
    for _ in range(2):  # two more steps at a fresh gradient of 0
        store.put_many([record(learner.current()[0], grad_like(learner, 0.0))])
        learner.update()
    assert learner.current()[0] == 3
    after = leaves(learner)
    # staleness 3 - 1 = 2 > 1 is dropped; 3 - 2 = 1 is applied
    store.put_many([record(1, grad_like(learner, 100.0)), record(2, grad_like(learner, 0.5))])
    result = learner.update()
    assert (result["applied"], result["dropped_stale"]) == (1, 1)
    np.testing.assert_allclose(leaves(learner)[0], after[0] - 0.5, rtol=1e-6)
    status = learner.status()
    assert status["received"] == 6 and status["dropped_stale"] == 1
    assert status["staleness_counts"][:3] == [4, 1, 1] and status["dropped_fraction"] == pytest.approx(1 / 6)
    assert set(status["family_losses"]) == {"quad", "other"}


def test_learner_rejects_nan_and_wrong_shape_gradients_counts_and_logs_them(tmp_path, caplog):
    store = GradientStore()
    learner = make_learner(tmp_path, store)
    start = leaves(learner)
    nan = grad_like(learner, 1.0)
    nan[0] = np.full_like(nan[0], np.nan)
    wrong_shape = grad_like(learner, 1.0)
    wrong_shape[-1] = np.zeros((3, 3), np.float32)
    with caplog.at_level(logging.WARNING, logger="carlskit.lopt.learner"):
        store.put_many([record(0, nan, id="nan-one"), record(0, wrong_shape, id="bad-shape"),
                        record(0, grad_like(learner, 1.0)[:-1], id="too-few"), record(7, grad_like(learner, 1.0))])
        result = learner.update()
    assert (result["applied"], result["rejected"]) == (0, 4)
    assert learner.status()["rejected"] == {"shape": 2, "non_finite": 1, "future_step": 1}
    assert "nan-one" in caplog.text and "bad-shape" in caplog.text
    assert learner.current()[0] == 0
    for got, want in zip(leaves(learner), start):
        np.testing.assert_array_equal(got, want)


def test_a_new_learner_resumes_from_the_latest_checkpoint(tmp_path):
    store = GradientStore()
    learner = make_learner(tmp_path, store, outer_optimizer=optax.adam(0.1), checkpoint_every_seconds=1e-6)
    for value in (1.0, -2.0, 0.5):
        store.put_many([record(learner.current()[0], grad_like(learner, value))])
        learner.update()
    assert learner.checkpoints.versions() == [0, 1, 2, 3]
    resumed = make_learner(tmp_path, store, outer_optimizer=optax.adam(0.1))
    assert resumed.resumed_from == 3 and resumed.current()[0] == 3
    for got, want in zip(leaves(resumed), leaves(learner)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(jax.tree.leaves(resumed.outer_state), jax.tree.leaves(learner.outer_state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # Adam's moments too
    assert resumed.status()["received"] == 3
    # both continue identically from the same gradient
    for one in (learner, resumed):
        store.put_many([record(3, grad_like(one, 0.25))])
        one.update()
    for got, want in zip(leaves(resumed), leaves(learner)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_learner_validates_arguments(tmp_path):
    with pytest.raises(ValueError, match="max_staleness"):
        make_learner(tmp_path, max_staleness=-1)
    with pytest.raises(ValueError, match="initial_meta_params"):
        make_learner(tmp_path, initial_meta_params={"wrong": np.zeros(3)})
