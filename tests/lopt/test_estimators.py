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
    make_full_es_estimator,
    make_pes_estimator,
    pes_gradient,
    pes_init_state,
    train_task,
)

QUADRATIC = QuadraticTask(dim=4, condition=10.0, noise_std=0.0)


def _true_gradient(rule, meta_params, task_keys, num_steps):
    def outer_loss(theta):
        losses = jax.vmap(lambda k: aggregate_losses(train_task(rule, QUADRATIC, theta, k, num_steps),
                                                     "mean"))(task_keys)
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


def test_outer_loss_is_nan_when_every_pair_diverges():
    rule = LearnableAdamRule()
    diverging = dict(rule.init_meta_params(), log_learning_rate=jnp.asarray(80.0))
    task_keys = jax.random.split(jax.random.PRNGKey(0), 4)
    _, metrics = full_es_gradient(diverging, jax.random.PRNGKey(1), task_keys, rule=rule,
                                  task=QuadraticTask(4, noise_std=0.1), num_steps=5)
    assert float(metrics["nan_fraction"]) == 1.0 and np.isnan(float(metrics["outer_loss"]))
    _, metrics = full_es_gradient(rule.init_meta_params(), jax.random.PRNGKey(1), task_keys, rule=rule,
                                  task=QuadraticTask(4, noise_std=0.1), num_steps=5)
    assert float(metrics["nan_fraction"]) == 0.0 and np.isfinite(float(metrics["outer_loss"]))


def test_estimator_sizes_and_options_are_checked_at_construction():
    from carlskit.lopt import pes_init_state, task_mesh

    rule = LearnableAdamRule()
    full = lambda **kw: make_full_es_estimator(rule, QUADRATIC, **{"num_tasks": 2, "num_steps": 5, **kw})
    pes = lambda **kw: make_pes_estimator(rule, QUADRATIC, **{"num_tasks": 2, "horizon": 10,
                                                               "truncation_length": 5, **kw})
    cases = [
        (lambda: full(num_tasks=0), ValueError, "num_tasks"),
        (lambda: full(num_steps=0), ValueError, "num_steps"),
        (lambda: full(num_tasks=1.5), TypeError, "num_tasks"),
        (lambda: full(std=0.0), ValueError, "std"),
        (lambda: full(aggregation="median"), ValueError, "aggregation"),
        (lambda: pes(num_tasks=-2), ValueError, "num_tasks"),
        (lambda: pes(horizon=5, truncation_length=2), ValueError, "multiple"),
        (lambda: pes(truncation_length=0), ValueError, "truncation_length"),
        (lambda: pes(aggregation="x"), ValueError, "aggregation"),
        (lambda: pes(std=float("nan")), ValueError, "std"),
        (lambda: pes_init_state(rule.init_meta_params(), jax.random.PRNGKey(0), rule=rule, task=QUADRATIC,
                                num_tasks=2, horizon=-4, truncation_length=2), ValueError, "horizon"),
        (lambda: task_mesh(0), ValueError, "num_tasks"),
        (lambda: task_mesh(-4), ValueError, "num_tasks"),
        (lambda: task_mesh(3.0), TypeError, "num_tasks"),
        (lambda: task_mesh(2, [jax.devices()[0]] * 2), ValueError, "distinct"),
    ]
    for make, error, name in cases:
        with pytest.raises(error, match=name):
            make()


def test_estimators_check_meta_params_against_the_rule():
    rule = MLPUpdateRule(hidden_sizes=(4,))
    wider = MLPUpdateRule(hidden_sizes=(8,)).init_meta_params(jax.random.PRNGKey(0))
    theta = rule.init_meta_params(jax.random.PRNGKey(0))
    full = make_full_es_estimator(rule, QUADRATIC, num_tasks=2, num_steps=3)
    pes = make_pes_estimator(rule, QUADRATIC, num_tasks=2, horizon=6, truncation_length=3)
    with pytest.raises(ValueError, match=r"meta_params\['layers'\]\[0\]\['b'\]: shape \(8,\), "
                                         r"MLPUpdateRule.init_meta_params gives \(4,\)"):
        full(wider, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"meta_params\['layers'\]\[0\]\['b'\]"):
        pes.init(wider, jax.random.PRNGKey(0))
    state = pes.init(theta, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"meta_params\['layers'\]\[0\]\['b'\]"):
        pes.gradient(wider, jax.random.PRNGKey(1), state)
    with pytest.raises(TypeError, match="dtype"):
        full(jax.tree.map(lambda x: x.astype(jnp.int32), theta), jax.random.PRNGKey(0))


def test_es_worker_checks_its_config_the_learners_meta_params_and_puts_no_diverged_records(tmp_path):
    import threading

    from carlskit.lopt import GradientStore, Learner, QuadraticFamily
    from carlskit.lopt._es_worker import ESWorkerConfig, run_es_worker

    for field, bad in [("num_tasks", 0), ("num_steps", -1), ("put_every", 0), ("std", 0.0), ("aggregation", "x")]:
        with pytest.raises(ValueError, match=field):
            ESWorkerConfig(**{field: bad})
    rule, family, config = LearnableAdamRule(), QuadraticFamily(dims=(4,)), ESWorkerConfig(num_tasks=2, num_steps=3)
    store = GradientStore()
    diverging = dict(rule.init_meta_params(), log_learning_rate=np.float32(80.0))
    learner = Learner(rule, store, str(tmp_path / "ckpt"), initial_meta_params=diverging)
    assert run_es_worker(0, learner, store, family, rule, config, threading.Event(), "t", max_rounds=1) == 0
    assert store.size() == 0
    small_rule = MLPUpdateRule(hidden_sizes=(4,))
    wide_learner = Learner(MLPUpdateRule(hidden_sizes=(8,)), store, str(tmp_path / "ckpt8"))
    with pytest.raises(ValueError, match=r"learner meta_params\['layers'\]\[0\]\['b'\]"):
        run_es_worker(0, wide_learner, store, family, small_rule, config, threading.Event(), "t", max_rounds=1)


def test_pes_with_sampled_horizons_restarts_episodes_of_log_uniform_lengths():
    from carlskit.lopt._estimators import sample_horizons

    lengths = np.asarray(sample_horizons(jax.random.PRNGKey(0), 4000, 10, 1000, 10))
    assert lengths.min() >= 10 and lengths.max() <= 1000 and np.all(lengths % 10 == 0)
    # Log-uniform: about as many episodes in [10, 100] as in (100, 1000].
    assert 0.4 < np.mean(lengths <= 100) < 0.6
    rule = LearnableAdamRule()
    task = QuadraticTask(4, 10.0, 0.1)
    theta = rule.init_meta_params(jax.random.PRNGKey(0))
    estimator = make_pes_estimator(rule, task, num_tasks=8, horizon=40, truncation_length=5, min_horizon=5)
    state, ends = estimator.init(theta, jax.random.PRNGKey(1)), set()
    for step in range(12):
        grad, state, metrics = estimator.gradient(theta, jax.random.PRNGKey(10 + step), state)
        ends |= set(np.asarray(state.episode_end).tolist())
        assert np.isfinite(metrics["outer_loss"])
    assert len(ends) >= 3 and max(ends) <= 40
    with pytest.raises(ValueError, match="min_horizon"):
        make_pes_estimator(rule, task, num_tasks=2, horizon=10, truncation_length=5, min_horizon=20)


def test_pes_perturbation_mask_freezes_the_masked_meta_parameters_and_keeps_the_others_draws():
    """``perturbation_mask`` (issue 41's two phases): a leaf under 0 gets no noise, so its gradient
    and accumulated noise are exactly 0; the leaves under 1 see the very draws of the unmasked
    estimator (same keys)."""
    rule = LearnableAdamRule(initial_learning_rate=0.05)
    meta_params = rule.init_meta_params()
    names = sorted(meta_params)
    mask = {name: jnp.float32(name != names[0]) for name in names}
    config = dict(rule=rule, task=QUADRATIC, num_tasks=3, horizon=20, truncation_length=10, std=0.01)
    state = pes_init_state(meta_params, jax.random.PRNGKey(0), **{k: v for k, v in config.items() if k != "std"})
    grad, masked, _ = pes_gradient(meta_params, jax.random.PRNGKey(1), state, perturbation_mask=mask, **config)
    _, unmasked, _ = pes_gradient(meta_params, jax.random.PRNGKey(1), state, **config)
    assert not np.any(np.asarray(grad[names[0]])) and not np.any(np.asarray(masked.accumulated_eps[names[0]]))
    for name in names[1:]:
        np.testing.assert_array_equal(masked.accumulated_eps[name], unmasked.accumulated_eps[name])
