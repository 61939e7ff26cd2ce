import jax
import numpy as np

from carlskit.lopt import MLPUpdateRule, QuadraticTask, train_tasks_serial, train_tasks_vectorized


def test_vectorized_and_serial_training_give_same_losses():
    rule = MLPUpdateRule(hidden_sizes=(8,), initial_learning_rate=0.05)
    meta_params = rule.init_meta_params(jax.random.PRNGKey(0))
    task = QuadraticTask(6, noise_std=0.1)  # per-instance curvature and centre, noisy minibatches
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    vectorized = np.asarray(train_tasks_vectorized(rule, task, meta_params, keys, 6))
    serial = np.asarray(train_tasks_serial(rule, task, meta_params, keys, 6))
    assert vectorized.shape == (3, 6)
    np.testing.assert_allclose(vectorized, serial, rtol=2e-5, atol=1e-6)
    assert np.all(vectorized[:, -1] < vectorized[:, 0])  # and it trains
