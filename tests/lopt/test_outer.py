"""The one outer core (``worker_estimate`` / ``learner_apply``) and the protocols the code is typed against."""

import typing

import jax
import numpy as np
import optax
import pytest

from carlskit.lopt import (
    DigitsConvTask,
    DigitsMLPFamily,
    DigitsMLPTask,
    LearnableAdam,
    LearnableAdamRule,
    MetaTraining,
    MLPUpdateRule,
    QuadraticFamily,
    QuadraticTask,
    Task,
    TaskFamily,
    UpdateRule,
    evaluation_curves,
    self_optimizer,
    train_task,
    unroll,
)


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


def test_meta_train_and_a_one_worker_cluster_give_the_same_meta_parameters(tmp_path):
    """Same seed, one ES worker, no staleness, one gradient per update: the cluster's learner applies
    exactly the gradients ``meta_train`` applies (both call worker_estimate and learner_apply, and the
    worker draws meta_train's OuterStream). Two task structures, so task sampling must agree too."""
    family, steps, seed = QuadraticFamily(dims=(2, 3), noise_std=0.1), 4, 7
    start = LearnableAdam()
    single = start.meta_train(family, steps, estimator="es", num_tasks=2, horizon=5, std=0.01,
                              meta_learning_rate=0.05, seed=seed, progress=False)
    # A worker that runs ahead of the learner estimates at a step again (a new key): those records
    # are one step stale when taken and max_staleness=0 drops them; checkpoints at every update let
    # us read the meta-parameters of exactly step ``steps`` whatever the learner did after it.
    training = MetaTraining(start, family, None, directory=tmp_path, num_workers=1, num_tasks=2, num_steps=5,
                            std=0.01, outer_optimizer=optax.adam(0.05), max_staleness=0, max_gradients_per_update=1,
                            checkpoint_every_seconds=1e-9, seed=seed, evaluate=False, summaries=False).start()
    try:
        training.wait(steps, timeout=300)
    finally:
        training.stop(evaluate_final=False)
    cluster = training.learned_optimizer(steps)
    assert not np.allclose(_flat(single.meta_params), _flat(start.meta_params)), "meta-training moved theta"
    np.testing.assert_allclose(_flat(cluster.meta_params), _flat(single.meta_params), rtol=1e-6, atol=1e-7)


def test_built_in_rules_tasks_and_families_satisfy_the_protocols():
    for rule in (MLPUpdateRule(), LearnableAdamRule()):
        assert isinstance(rule, UpdateRule) and hash(rule) == hash(type(rule)()), rule
    for task in (QuadraticTask(), DigitsMLPTask(), DigitsConvTask()):
        assert isinstance(task, Task) and not isinstance(task, TaskFamily), task
    rng = np.random.default_rng(0)
    for family in (QuadraticFamily(), DigitsMLPFamily()):
        assert isinstance(family, TaskFamily) and not isinstance(family, Task), family
        assert all(isinstance(task, Task) for task in family.tasks()) and isinstance(family.sample(rng), Task)


class _PlainSGD:
    """An update rule that never heard of ``UpdateRule``: structural typing, like optax's transformations."""

    def init_meta_params(self, key=None):
        return {"log_lr": np.float32(-2.0)}

    def init_state(self, params):
        return {}

    def update(self, meta_params, state, grads, params, time_scale=1.0):
        return jax.tree.map(lambda g: -np.exp(meta_params["log_lr"]) * g, grads), state


def test_protocols_are_structural_and_the_code_is_typed_against_them():
    rule = _PlainSGD()
    assert isinstance(rule, UpdateRule) and not isinstance(object(), UpdateRule)
    assert not isinstance(QuadraticTask(), UpdateRule) and not isinstance(rule, Task)
    losses = train_task(rule, QuadraticTask(4), rule.init_meta_params(), jax.random.PRNGKey(0), 20)
    assert losses[-1] < losses[0]
    for function in (train_task, unroll, evaluation_curves.__wrapped__):
        hints = typing.get_type_hints(function)
        assert hints["rule"] is UpdateRule and hints["task"] is Task, function


def test_self_optimizer_warms_up_with_its_warmup_then_is_the_rule_on_its_own_meta_parameters():
    rule = LearnableAdamRule(initial_learning_rate=0.1)
    theta = rule.init_meta_params()
    grads = jax.tree.map(lambda x: np.ones_like(x) * 0.5, theta)
    tx = self_optimizer(rule, warmup=optax.sgd(1.0), warmup_steps=1)
    state = tx.init(theta)
    first, state = tx.update(grads, state, theta)
    np.testing.assert_allclose(_flat(first), -_flat(grads))  # warm-up: SGD's step
    rule_state = rule.update(theta, rule.init_state(theta), grads, theta)[1]
    second, _ = tx.update(grads, state, theta)
    np.testing.assert_allclose(_flat(second), _flat(rule.update(theta, rule_state, grads, theta)[0]), rtol=1e-6)
    with pytest.raises(ValueError, match="outer_optimizer"):
        LearnableAdam().meta_train(QuadraticTask(4), 1, outer_optimizer="sgd", progress=False)
    with pytest.raises(TypeError, match="outer_optimizer"):
        MetaTraining(LearnableAdam(), QuadraticTask(4), None, directory="unused", outer_optimizer=0.1)


def test_self_training_runs_on_the_cluster_and_its_outer_loss_falls(tmp_path):
    """The learner updates the meta-parameters with the learned optimizer they define (here
    LearnableAdam's Adam, whose learned learning rate is then also the outer one). The outer loss is
    the mean training loss of a 10-step unroll: measured on 32 fixed instances before and after.
    Measured (meta_train with outer_optimizer="self", which this run reproduces): 0.33 of the start after
    20 outer steps (seeds 1, 2: 0.45, 0.34); the learned learning rate went 0.05 -> 0.70 (0.53-1.14)."""
    task, start = QuadraticTask(4, 10.0, 0.1), LearnableAdam(initial_learning_rate=0.05)
    training = MetaTraining(start, task, None, directory=tmp_path, num_workers=1, num_tasks=8, num_steps=10,
                            std=0.01, outer_optimizer="self", max_staleness=0, max_gradients_per_update=1, seed=0,
                            checkpoint_every_seconds=1e-9, evaluate=False, summaries=False).start()
    try:
        training.wait(20, timeout=300)
    finally:
        training.stop(evaluate_final=False)
    # Checkpoint 20 exactly (a checkpoint every step; one gradient per update, none stale): the
    # deterministic sequence meta_train takes. Unclipped self-training of LearnableAdam can blow up
    # a few steps later on some seeds (notebook 07 clips its outer updates), so later steps are not read.
    trained = training.learned_optimizer(20)
    before = start.train_curves(task, 10, num_tasks=32, seed=99).mean()
    after = trained.train_curves(task, 10, num_tasks=32, seed=99).mean()
    assert after < 0.8 * before, (before, after)
