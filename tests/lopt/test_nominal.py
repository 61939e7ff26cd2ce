import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from carlskit.lopt import LearnedOptimizer, NominalAdamRule, QuadraticTask, optax_train_curves
from carlskit.lopt._nominal import LOSS_DECAYS, update_loss_trend
from carlskit.lopt._outer import self_optimizer
from carlskit.lopt._protocols import call_update, uses_loss_and_num_steps
from carlskit.lopt._rule_config import rule_from_config, rule_to_config
from carlskit.lopt.meta_training import init_inner_state, make_pes_estimator, unroll

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.linspace(0.5, -0.5, 4)}
OPTAX_SCHEDULES = {"cosine": lambda lr, n: optax.cosine_decay_schedule(lr, n),
                   "linear": lambda lr, n: optax.linear_schedule(lr, 0.0, n),
                   "constant": lambda lr, n: lr}


def _loss(params, i):
    return jnp.sum(jnp.sin(3.0 * params["w"] + i)) + (1.0 + i) * jnp.sum(jnp.square(params["b"]))


def _run(tx, num_steps, pass_value):
    params, state = PARAMS, tx.init(PARAMS)
    for i in range(num_steps):
        value, grads = jax.value_and_grad(_loss)(params, i)
        extra = {"value": value} if pass_value else {}
        updates, state = tx.update(grads, state, params, **extra)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("schedule", sorted(OPTAX_SCHEDULES))
def test_untrained_nominal_adam_is_optax_adam_under_its_default_schedule(schedule):
    """Peer check: with the zero scheduler output and zero correction gain it starts with, the rule
    is optax.adam(schedule(learning_rate, num_steps)) step for step on a multi-tensor tree."""
    rule, num_steps = NominalAdamRule(learning_rate=3e-2, schedule=schedule), 8
    ours = _run(LearnedOptimizer(rule, rule.init_meta_params(jax.random.PRNGKey(0))).as_optax(num_steps=num_steps),
                num_steps, pass_value=True)
    reference = _run(optax.adam(OPTAX_SCHEDULES[schedule](3e-2, num_steps)), num_steps, pass_value=False)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_the_default_untrained_rule_is_adam_with_a_linear_decay_from_3e_2():
    """The defaults a campaign starts from (chosen by a sweep on the meta-training family, see the
    class docstring): optax.adam(optax.linear_schedule(3e-2, 0, num_steps))."""
    rule, num_steps = NominalAdamRule(), 8
    assert (rule.learning_rate, rule.schedule) == (3e-2, "linear")
    ours = _run(LearnedOptimizer(rule, rule.init_meta_params(jax.random.PRNGKey(0))).as_optax(num_steps=num_steps),
                num_steps, pass_value=True)
    reference = _run(optax.adam(optax.linear_schedule(3e-2, 0.0, num_steps)), num_steps, pass_value=False)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_inner_loop_gives_the_rule_the_real_loss_and_the_run_length():
    """Through the inner loop (train_curves: vmapped unrolls) the untrained rule's losses are
    optax's linearly decayed Adam's on the same instances; the loss statistics saw every real loss."""
    rule, task, num_steps = NominalAdamRule(learning_rate=5e-2), QuadraticTask(6, noise_std=0.1), 12
    theta = rule.init_meta_params(jax.random.PRNGKey(1))
    ours = LearnedOptimizer(rule, theta).train_curves(task, num_steps, num_tasks=2, seed=3)
    reference = optax_train_curves(optax.adam(optax.linear_schedule(5e-2, 0.0, num_steps)), task, num_steps,
                                   num_tasks=2, seed=3)
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-6)
    assert ours[:, -1].mean() < 0.9 * ours[:, 0].mean()  # it trains

    task_key = jax.random.PRNGKey(4)
    task_params = task.sample_task_params(jax.random.fold_in(task_key, 2))
    state = init_inner_state(rule, task, task_key, task_params)
    final, losses = jax.jit(lambda s: unroll(rule, task, theta, s, task_key, task_params, num_steps))(state)
    trend = final.opt_state["loss_trend"]
    assert int(trend["count"]) == num_steps and int(final.opt_state["step"]) == num_steps
    np.testing.assert_allclose(trend["initial"], losses[0], rtol=1e-6)
    decays = np.asarray(LOSS_DECAYS)
    ema = sum((1 - decays) * decays ** (num_steps - 1 - t) * float(losses[t]) for t in range(num_steps))
    np.testing.assert_allclose(trend["ema"], ema, rtol=1e-5)


def test_scheduler_scales_the_step_exponentially_and_the_correction_is_bounded_per_tensor():
    rule = NominalAdamRule(learning_rate=1e-2, schedule="constant", correction_scale=0.5)
    theta = rule.init_meta_params(jax.random.PRNGKey(2))
    grads = jax.tree.map(jnp.cos, PARAMS)
    state = rule.init_state(PARAMS)

    def step(meta_params, num_steps=10, loss=3.0):
        return rule.update(meta_params, state, grads, PARAMS, loss=jnp.asarray(loss), num_steps=num_steps)[0]

    base = step(theta)
    # lr = learning_rate * s(f) * exp(w2 . h + b2): the output bias b2 = d scales the step by e^d exactly
    for shift in (math.log(2.0), -1.5):
        moved = step({**theta, "scheduler": {**theta["scheduler"], "out": {**theta["scheduler"]["out"],
                                                                           "b": jnp.asarray(shift)}}})
        for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(base)):
            np.testing.assert_allclose(a, math.exp(shift) * b, rtol=1e-5)
    # the output weights read the features: the loss trend (a second, higher loss) moves the step
    reading = {**theta, "scheduler": {**theta["scheduler"], "out": {**theta["scheduler"]["out"],
                                                                    "w": jnp.ones((rule.scheduler_hidden_size,))}}}
    trend, _ = update_loss_trend(state["loss_trend"], jnp.asarray(3.0))
    later = {**state, "loss_trend": trend, "step": jnp.asarray(1, jnp.int32)}
    up = rule.update(reading, later, grads, PARAMS, loss=jnp.asarray(9.0), num_steps=10)[0]["b"]
    down = rule.update(reading, later, grads, PARAMS, loss=jnp.asarray(0.3), num_steps=10)[0]["b"]
    assert not np.allclose(up, down, rtol=1e-3)
    # the correction: RMS over each tensor is correction_scale * |tanh(gain)|, never above correction_scale
    for gain, rms in ((math.atanh(0.6), 0.3), (50.0, 0.5), (-50.0, 0.5)):
        corrected = step({**theta, "correction": {**theta["correction"], "gain": jnp.asarray(gain)}})
        for name in PARAMS:
            correction = (np.asarray(corrected[name]) - np.asarray(base[name])) / -1e-2
            np.testing.assert_allclose(np.sqrt(np.mean(correction ** 2)), rms, rtol=1e-4)
            assert not np.allclose(corrected[name], base[name])


def test_nominal_adam_checks_its_arguments_naming_them():
    for field, bad, error in (("learning_rate", 0.0, ValueError), ("learning_rate", "a", TypeError),
                              ("schedule", "exponential", ValueError), ("b1", 1.0, ValueError),
                              ("b2", -0.1, ValueError), ("epsilon", 0.0, ValueError),
                              ("correction_scale", -1.0, ValueError), ("correction_scale", math.inf, ValueError),
                              ("correction_hidden_sizes", (), ValueError), ("scheduler_hidden_size", 0, ValueError)):
        with pytest.raises(error, match=field):
            NominalAdamRule(**{field: bad})
    rule = NominalAdamRule()
    theta = rule.init_meta_params(jax.random.PRNGKey(0))
    optimizer = LearnedOptimizer(rule, theta)
    with pytest.raises(ValueError, match="num_steps"):
        optimizer.as_optax()
    tx = optimizer.as_optax(num_steps=5)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    with pytest.raises(ValueError, match="value"):
        tx.update(grads, tx.init(PARAMS), PARAMS)
    state = rule.init_state(PARAMS)
    with pytest.raises(ValueError, match="loss"):
        rule.update(theta, state, grads, PARAMS, loss=jnp.ones(2), num_steps=5)
    with pytest.raises(ValueError, match="num_steps"):
        rule.update(theta, state, grads, PARAMS, loss=1.0, num_steps=0)
    with pytest.raises(ValueError, match="loss"):
        call_update(rule, theta, state, grads, PARAMS, num_steps=5)
    with pytest.raises(ValueError, match="state: expected"):
        rule.update(theta, {"mu": state["mu"], "nu": state["nu"], "step": state["step"]}, grads, PARAMS,
                    loss=1.0, num_steps=5)
    with pytest.raises(ValueError, match="rule"):
        self_optimizer(rule)
    # rules that do not read them are called as before
    assert uses_loss_and_num_steps(rule) and not uses_loss_and_num_steps(LearnedOptimizer().rule)


def test_nominal_adam_round_trips_through_its_config_and_a_file(tmp_path):
    rule = NominalAdamRule(learning_rate=1e-3, schedule="linear", correction_scale=0.25,
                           correction_hidden_sizes=(3,), scheduler_hidden_size=5)
    assert rule_from_config(rule_to_config(rule)) == rule
    theta = jax.tree.map(lambda x: x + 0.1, rule.init_meta_params(jax.random.PRNGKey(5)))
    loaded = LearnedOptimizer.load(LearnedOptimizer(rule, theta, train_horizon=40).save(None, tmp_path / "nominal"))
    assert loaded.rule == rule and loaded.train_horizon == 40
    assert jax.tree.structure(loaded.meta_params) == jax.tree.structure(theta)
    for a, b in zip(jax.tree.leaves(loaded.meta_params), jax.tree.leaves(theta)):
        np.testing.assert_array_equal(a, b)


def test_pes_gives_a_finite_nonzero_meta_gradient_for_the_schedule_and_the_correction():
    rule = NominalAdamRule(learning_rate=3e-2, correction_hidden_sizes=(4,), scheduler_hidden_size=4)
    estimator = make_pes_estimator(rule, QuadraticTask(4, noise_std=0.1), num_tasks=4, horizon=10,
                                   truncation_length=5, std=0.1, devices=jax.local_devices()[:1])
    theta = rule.init_meta_params(jax.random.PRNGKey(0))
    state = estimator.init(theta, jax.random.PRNGKey(1))
    grad, state, metrics = estimator.gradient(theta, jax.random.PRNGKey(2), state)
    assert float(metrics["nan_fraction"]) == 0.0
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grad))
    assert float(jnp.abs(grad["scheduler"]["out"]["b"])) > 0 and float(jnp.abs(grad["correction"]["gain"])) > 0
    # each member's rule state counted the truncation's losses
    np.testing.assert_array_equal(state.inner.opt_state["loss_trend"]["count"], 5)


def test_mean_log_loss_ratio_is_the_log_of_the_geometric_mean_ratio_with_the_floor():
    from carlskit.lopt import geometric_mean_ratio
    from carlskit.lopt.meta_training import mean_log_loss_ratio

    final, adam, initial = np.array([0.5, 2.0, 1e-6]), np.array([1.0, 1.0, 1e-5]), np.array([4.0, 4.0, 1.0])
    # the third task: both below 1e-3 of its initial loss, a tie
    want = math.log(geometric_mean_ratio([{"ratio": 0.5}, {"ratio": 2.0}, {"ratio": 1.0}]))
    np.testing.assert_allclose(mean_log_loss_ratio(final, adam, initial), want, atol=1e-6)
    np.testing.assert_allclose(mean_log_loss_ratio(final[:2], adam[:2]), 0.0, atol=1e-6)
    assert float(mean_log_loss_ratio(np.array([np.nan, 1.0]), np.ones(2))) == math.inf
    with pytest.raises(ValueError, match="reference_losses"):
        mean_log_loss_ratio(final, adam[:2])
    with pytest.raises(ValueError, match="initial_losses"):
        mean_log_loss_ratio(final, adam, initial[:1])
    with pytest.raises(ValueError, match="final_losses"):
        mean_log_loss_ratio(np.ones((2, 2)), np.ones((2, 2)))
    with pytest.raises(ValueError, match="floor_fraction"):
        mean_log_loss_ratio(final, adam, initial, floor_fraction=0.0)


@pytest.mark.parametrize("granularity", ["global", "tensor", "entry"])
def test_weight_scale_augmentation_at_each_granularity_keeps_the_problem(granularity):
    """Celo's augmentation: params = scale * q with scales in [1e-3, 1e3]; the loss at the start is
    the wrapped task's, the gradient seen is scaled by ``scale``, and the scales vary as named."""
    from carlskit.lopt import DeepLinearTask, RescaledTask

    inner = DeepLinearTask(width=4, depth=3, batch_size=8)
    task = RescaledTask(inner, max_scale=1e3, granularity=granularity)
    key = jax.random.PRNGKey(0)
    task_params = task.sample_task_params(key)
    scales = jax.tree.leaves(task_params["scales"])
    q = task.init(key, task_params)
    batch = task.batch(key, task_params)
    p = inner.init(key, task_params["inner"])
    np.testing.assert_allclose(task.loss(q, batch, task_params), inner.loss(p, batch, task_params["inner"]),
                               rtol=1e-5)
    grad_q, grad_p = jax.grad(task.loss)(q, batch, task_params), jax.grad(inner.loss)(p, batch, task_params["inner"])
    for gq, gp, s in zip(jax.tree.leaves(grad_q), jax.tree.leaves(grad_p), scales):
        np.testing.assert_allclose(gq, gp * s, rtol=1e-4, atol=1e-6)
    values = np.concatenate([np.ravel(s) for s in scales])
    assert np.all((values >= 1e-3 * 0.999) & (values <= 1e3 * 1.001))
    distinct = len(np.unique(values))
    assert distinct == {"global": 1, "tensor": len(scales), "entry": values.size}[granularity]
    with pytest.raises(ValueError, match="granularity"):
        RescaledTask(inner, granularity="layer")
