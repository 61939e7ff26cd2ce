import jax
import numpy as np
import pytest

from carlskit.lopt import LearnedOptimizer, MLPUpdateRule, QuadraticFamily, QuadraticTask


def test_meta_training_lowers_outer_loss():
    """PES meta-training (full-unroll ES is checked against jax.grad in test_estimators)."""
    estimator = "pes"
    family = QuadraticFamily(dims=(8,), noise_std=0.1)
    rule = MLPUpdateRule(hidden_sizes=(8,), initial_learning_rate=1e-3)
    start = LearnedOptimizer(rule)
    start.meta_params = start.init(jax.random.PRNGKey(0))
    trained = start.meta_train(family, 60, estimator=estimator, num_tasks=16, horizon=20, truncation_length=10,
                               std=0.01, meta_learning_rate=0.03, progress=False)
    assert len(trained.history["outer_loss"]) == 60 and trained is not start
    task = QuadraticTask(8, 10.0, 0.1)
    before = start.train_curves(task, 20, num_tasks=32, seed=99).mean()
    after = trained.train_curves(task, 20, num_tasks=32, seed=99).mean()
    assert after < 0.8 * before, (before, after)
    first, last = np.mean(trained.history["outer_loss"][:10]), np.mean(trained.history["outer_loss"][-10:])
    assert last < first


def test_meta_train_validates_arguments():
    optimizer = LearnedOptimizer(MLPUpdateRule(hidden_sizes=(4,)))
    with pytest.raises(ValueError, match="estimator"):
        optimizer.meta_train(QuadraticFamily(), 1, estimator="sgd")
    with pytest.raises(ValueError, match="truncation_length"):
        optimizer.meta_train(QuadraticFamily(), 1, horizon=30, truncation_length=20)
    with pytest.raises(TypeError, match="task_family"):
        optimizer.meta_train("digits", 1)
