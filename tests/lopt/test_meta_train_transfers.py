"""Accelerator-ready meta-training: with ``CARLSKIT_TRANSFER_GUARD=disallow``, ``meta_train``'s
steady-state outer steps (inner training of every antithetic pair, then the learner's update) move
nothing between host and device but the gradient record out and its mean back in (issue 40).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from carlskit.lopt import LearnedOptimizer, MLPUpdateRule, QuadraticFamily, QuadraticTask


@pytest.fixture
def guarded(monkeypatch):
    """The loops' steady-state steps run under ``jax.transfer_guard("disallow")``."""
    monkeypatch.setenv("CARLSKIT_TRANSFER_GUARD", "disallow")


def start() -> LearnedOptimizer:
    optimizer = LearnedOptimizer(MLPUpdateRule(hidden_sizes=(4,)))
    optimizer.meta_params = optimizer.init(jax.random.PRNGKey(0))
    return optimizer


def test_pes_meta_training_transfers_only_the_gradient_record_and_its_mean(guarded):
    # A task structure's first outer step is set-up, unguarded (PES makes its state unjitted, on
    # purpose: once per structure); its later steps are the steady state.
    trained = start().meta_train(QuadraticFamily(dims=(4, 8), noise_std=0.1), 6, num_tasks=4, horizon=10,
                                 truncation_length=5, progress=False)
    assert len(trained.history) == 6 and np.all(np.isfinite(trained.history.column("outer_loss")))


def test_es_meta_training_transfers_only_the_gradient_record_and_its_mean(guarded):
    trained = start().meta_train(QuadraticTask(4, 10.0, 0.1), 4, estimator="es", num_tasks=4, horizon=10,
                                 progress=False)
    assert len(trained.history) == 4 and np.all(np.isfinite(trained.history.column("outer_loss")))
