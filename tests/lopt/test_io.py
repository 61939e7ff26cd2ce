import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax

from carlskit.lopt import LearnableAdam, LearnedOptimizer, MLPUpdateRule


def test_save_load_roundtrip_without_pickle(tmp_path):
    rule = MLPUpdateRule(hidden_sizes=(8, 4), decays=(0.5, 0.9))
    optimizer = LearnedOptimizer(rule, rule.init_meta_params(jax.random.PRNGKey(3)), train_horizon=50)
    base = optimizer.save(None, tmp_path / "opt")
    assert sorted(os.listdir(tmp_path)) == ["opt.json", "opt.npz"]  # no temp files left behind
    with np.load(tmp_path / "opt.npz", allow_pickle=False) as data:
        assert len(data.files) == len(jax.tree.leaves(optimizer.meta_params))
    assert json.loads((tmp_path / "opt.json").read_text())["config"]["rule"]["kind"] == "mlp"
    loaded = LearnedOptimizer.load(base)
    assert loaded.rule == rule and loaded.train_horizon == 50
    assert jax.tree.structure(loaded.meta_params) == jax.tree.structure(optimizer.meta_params)
    for a, b in zip(jax.tree.leaves(loaded.meta_params), jax.tree.leaves(optimizer.meta_params)):
        np.testing.assert_array_equal(a, b)
    # Same file extension given explicitly also works; the adam baseline round-trips too.
    adam = LearnableAdam(initial_learning_rate=3e-3)
    adam.save(None, tmp_path / "adam.json")
    assert LearnedOptimizer.load(tmp_path / "adam.npz").rule == adam.rule


def test_load_missing_file_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="path"):
        LearnedOptimizer.load(tmp_path / "nothing")


def test_pretrained_ships_and_works_with_no_meta_training():
    optimizer = LearnedOptimizer.pretrained()
    assert optimizer.train_horizon == 200 and optimizer.info["outer_steps"] > 0
    tx = optimizer.as_optax()
    loss = lambda p: jnp.sum(jnp.square(p["w"] - 1.0)) + jnp.sum(jnp.square(p["b"]))
    params = {"w": jnp.zeros((4, 3)), "b": jnp.ones((3,))}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    start = loss(params)
    for _ in range(20):
        params, state = step(params, state)
    assert float(loss(params)) < float(start)
