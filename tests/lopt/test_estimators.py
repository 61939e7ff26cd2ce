import jax
import jax.numpy as jnp
import numpy as np
import pytest

from carlskit.lopt import (
    LearnableAdamRule,
    MLPUpdateRule,
    QuadraticTask,
    aggregate_losses,
    full_es_gradient,
    make_pes_estimator,
    train_task,
)

QUADRATIC = QuadraticTask(dim=4, condition=10.0, noise_std=0.0)


def _true_gradient(rule, meta_params, task_keys, num_steps):
    def outer_loss(theta):
        losses = jax.vmap(lambda k: aggregate_losses(train_task(rule, QUADRATIC, theta, k, num_steps), "mean"))(task_keys)
        return jnp.mean(losses)
    return jax.jit(jax.grad(outer_loss))(meta_params)


def _flat(tree):
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


@pytest.mark.parametrize(
    "rule, num_pairs, min_cosine, max_relative_error",
    [(LearnableAdamRule(initial_learning_rate=0.05), 4096, 0.99, 0.1),
     (MLPUpdateRule(hidden_sizes=(4,), initial_learning_rate=0.05), 8192, 0.9, 0.45)],
    ids=["adam", "mlp"])
def test_es_gradient_is_unbiased_on_quadratic(rule, num_pairs, min_cosine, max_relative_error):
    """ES with many antithetic pairs matches jax.grad through the same unrolls."""
    meta_params = rule.init_meta_params(jax.random.PRNGKey(0))
    task_keys = jax.random.split(jax.random.PRNGKey(1), num_pairs)
    num_steps = 10
    es, metrics = full_es_gradient(meta_params, jax.random.PRNGKey(2), task_keys, rule=rule, task=QUADRATIC,
                                   num_steps=num_steps, std=1e-3)
    true = _true_gradient(rule, meta_params, task_keys, num_steps)
    es, true = _flat(es), _flat(true)
    cosine = es @ true / (np.linalg.norm(es) * np.linalg.norm(true))
    relative_error = np.linalg.norm(es - true) / np.linalg.norm(true)
    assert float(metrics["nan_fraction"]) == 0.0
    assert cosine > min_cosine, cosine
    assert relative_error < max_relative_error, relative_error


def test_antithetic_pairs_share_initialisation_and_minibatches():
    """One step, loss taken before any update: it depends only on init and batch, so both members
    of a pair must agree exactly even under a large perturbation, while pairs differ."""
    rule = MLPUpdateRule(hidden_sizes=(4,))
    meta_params = rule.init_meta_params(jax.random.PRNGKey(0))
    task = QuadraticTask(4, noise_std=0.5)  # its minibatches are noise draws
    task_keys = jax.random.split(jax.random.PRNGKey(5), 4)
    _, metrics = full_es_gradient(meta_params, jax.random.PRNGKey(6), task_keys, rule=rule, task=task,
                                  num_steps=1, std=1.0, aggregation="last")
    pair_losses = np.asarray(metrics["pair_losses"])
    np.testing.assert_array_equal(pair_losses[:, 0], pair_losses[:, 1])
    assert len(set(pair_losses[:, 0].tolist())) == 4


def test_pes_pairs_stay_in_step_and_restart_after_horizon():
    rule = LearnableAdamRule(initial_learning_rate=0.05)
    meta_params = rule.init_meta_params()
    estimator = make_pes_estimator(rule, QUADRATIC, num_tasks=3, horizon=20, truncation_length=10, std=0.01)
    state = estimator.init(meta_params, jax.random.PRNGKey(0))
    for i in range(4):
        grad, state, metrics = estimator.gradient(meta_params, jax.random.PRNGKey(10 + i), state)
        steps = np.asarray(state.inner.step)
        np.testing.assert_array_equal(steps[:, 0], steps[:, 1])
        assert steps.max() <= 20 and steps.min() >= 10
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grad))
    # Pair members share the task key, hence the same minibatches along the whole episode.
    assert state.task_keys.shape[0] == 3


def test_pes_matches_true_gradient_on_average():
    """With one truncation per episode PES is full-unroll ES; its mean points along jax.grad."""
    rule = LearnableAdamRule(initial_learning_rate=0.05)
    meta_params = rule.init_meta_params()
    estimator = make_pes_estimator(rule, QUADRATIC, num_tasks=2048, horizon=10, truncation_length=10, std=1e-3)
    state = estimator.init(meta_params, jax.random.PRNGKey(0))
    grad, state, _ = estimator.gradient(meta_params, jax.random.PRNGKey(1), state)
    true = _true_gradient(rule, meta_params, state.task_keys, 10)
    cosine = _flat(grad) @ _flat(true) / (np.linalg.norm(_flat(grad)) * np.linalg.norm(_flat(true)))
    assert cosine > 0.97, cosine


def test_nan_guard_drops_diverged_pairs():
    rule = LearnableAdamRule()
    meta_params = dict(rule.init_meta_params(), log_learning_rate=jnp.asarray(80.0))  # lr = e^80: diverges
    task_keys = jax.random.split(jax.random.PRNGKey(0), 4)
    grad, metrics = full_es_gradient(meta_params, jax.random.PRNGKey(1), task_keys, rule=rule,
                                     task=QuadraticTask(4, noise_std=0.1), num_steps=5)
    assert float(metrics["nan_fraction"]) == 1.0
    assert all(bool(jnp.all(g == 0)) for g in jax.tree.leaves(grad))
    estimator = make_pes_estimator(rule, QUADRATIC, num_tasks=2, horizon=20, truncation_length=5)
    state = estimator.init(meta_params, jax.random.PRNGKey(0))
    grad, state, metrics = estimator.gradient(meta_params, jax.random.PRNGKey(1), state)
    assert float(metrics["nan_fraction"]) == 1.0
    assert np.all(np.asarray(state.episode_end) == 0)  # restarted at the next call


def test_loss_aggregation_options():
    losses = jnp.asarray([[3.0, 2.0, 1.0]])
    assert float(aggregate_losses(losses, "mean")[0]) == 2.0
    assert float(aggregate_losses(losses, "last")[0]) == 1.0
    with pytest.raises(ValueError, match="aggregation"):
        aggregate_losses(losses, "median")
    with pytest.raises(ValueError, match="horizon"):
        make_pes_estimator(LearnableAdamRule(), QUADRATIC, num_tasks=2, horizon=25, truncation_length=10).init(
            LearnableAdamRule().init_meta_params(), jax.random.PRNGKey(0))
